"""Upload admission: bounded buffer bytes, concurrency for small updates, none starved."""

from __future__ import annotations

import asyncio

import pytest

from flotilla.server.federation.budget import ByteBudget

pytestmark = pytest.mark.timeout(10)


async def test_small_updates_share_the_budget_and_large_ones_queue() -> None:
    budget = ByteBudget(100)
    peak = 0
    inside = 0

    async def upload(nbytes: int) -> None:
        nonlocal peak, inside
        async with budget.hold(nbytes):
            inside += nbytes
            peak = max(peak, inside)
            await asyncio.sleep(0.01)
            inside -= nbytes

    await asyncio.gather(*(upload(10) for _ in range(10)))
    assert peak == 100, "ten 10-byte uploads run together"
    peak = 0
    await asyncio.gather(*(upload(60) for _ in range(5)))
    assert peak == 60, "60-byte uploads run one at a time"
    assert budget.used == 0


async def test_an_update_larger_than_the_budget_still_runs_alone() -> None:
    budget = ByteBudget(100)
    second = budget.hold(1)
    async with budget.hold(1000):
        assert budget.used == 100
        waiter = asyncio.ensure_future(second.__aenter__())
        await asyncio.sleep(0.01)
        assert not waiter.done(), "nothing else runs beside it"
    await asyncio.wait_for(waiter, 1)
    assert budget.used == 1
    await second.__aexit__(None, None, None)
    assert budget.used == 0


async def test_a_cancelled_upload_returns_its_bytes() -> None:
    budget = ByteBudget(100)

    async def stuck() -> None:
        async with budget.hold(80):
            await asyncio.sleep(60)

    task = asyncio.ensure_future(stuck())
    await asyncio.sleep(0.01)
    assert budget.used == 80
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert budget.used == 0
