"""The multi-job arbiter: joint decisions, equal shares, quorums, reservations."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from flotilla.core.device import DeviceProfile
from flotilla.scheduling import Arbiter, DevicePool, DeviceRequest, Grant, Leases, RandomSelector

pytestmark = pytest.mark.timeout(30)


def pool_with(n: int, task: str = "t", start: int = 0) -> DevicePool:
    pool = DevicePool(time.monotonic)
    add(pool, n, task, start)
    return pool


def add(pool: DevicePool, n: int, task: str = "t", start: int = 0) -> None:
    for i in range(start, start + n):
        pool.seen(DeviceProfile(f"d{i:03d}", tasks=(task,)))


def request(job: str, want: int, quorum: int = 1, task: str = "t") -> DeviceRequest:
    return DeviceRequest(job, task, want, quorum, RandomSelector(random.Random(job)))


def claim(pool: DevicePool, grant: Grant) -> list[str]:
    """Redeem the grant as a job does right before it dispatches; the devices it got."""
    lease = Leases(pool).dispatch(grant, list)
    return [] if lease is None else list(lease.devices)


def arbiter_for(pool: DevicePool, grace_s: float = 10.0) -> Arbiter:
    return Arbiter(pool, time.monotonic, grace_s=grace_s, poll_s=0.01)


async def test_jobs_asking_at_once_share_the_idle_devices_equally() -> None:
    pool = pool_with(12)
    arbiter = arbiter_for(pool, grace_s=0.0)
    a, b = await asyncio.gather(
        arbiter.acquire(request("a", 10)), arbiter.acquire(request("b", 10))
    )
    assert len(a.devices) == len(b.devices) == 6
    assert not set(a.devices) & set(b.devices)
    assert a.contenders == b.contenders == 2
    assert a.metrics()["sched_candidates"] == 12.0
    assert set(claim(pool, a)) == set(a.devices)
    assert all(pool.busy_with(d) == "a" for d in a.devices)
    assert set(claim(pool, b)) == set(b.devices)
    await arbiter.close()


async def test_a_quorum_is_honoured_before_an_equal_share() -> None:
    pool = pool_with(12)
    arbiter = arbiter_for(pool, grace_s=0.0)
    a, b = await asyncio.gather(
        arbiter.acquire(request("a", 10, quorum=8)), arbiter.acquire(request("b", 10, quorum=2))
    )
    assert (len(a.devices), len(b.devices)) == (8, 4)
    await arbiter.close()


async def test_granted_devices_are_reserved_until_claimed_or_released() -> None:
    pool = pool_with(5)
    arbiter = arbiter_for(pool)
    grant = await arbiter.acquire(request("a", 3))
    free = {p.device_id for p in arbiter.idle("t")}
    assert free.isdisjoint(grant.devices) and len(free) == 2
    assert len(pool.idle("t")) == 5, "reserved, not yet busy"
    arbiter.release(grant)
    assert len(arbiter.idle("t")) == 5
    assert claim(pool, grant) == [], "a released grant claims nothing"
    await arbiter.close()


async def test_a_job_waits_until_devices_come_and_then_gets_them() -> None:
    pool = pool_with(2)
    arbiter = arbiter_for(pool)
    waiting = asyncio.ensure_future(arbiter.acquire(request("a", 4, quorum=3)))
    await asyncio.sleep(0.05)
    assert not waiting.done(), "2 devices: below its quorum of 3"
    add(pool, 2, start=2)
    grant = await asyncio.wait_for(waiting, 5)
    assert len(grant.devices) == 4 and grant.waited_s >= 0.04
    await arbiter.close()


async def test_after_the_grace_period_the_quorum_is_enough() -> None:
    pool = pool_with(3)
    arbiter = arbiter_for(pool, grace_s=0.1)
    started = time.monotonic()
    grant = await asyncio.wait_for(arbiter.acquire(request("a", 10, quorum=2)), 5)
    assert len(grant.devices) == 3 and time.monotonic() - started >= 0.1
    await arbiter.close()


async def test_a_cancelled_request_leaves_nothing_reserved() -> None:
    pool = pool_with(4)
    arbiter = arbiter_for(pool)
    waiting = asyncio.ensure_future(arbiter.acquire(request("a", 6, quorum=5)))
    await asyncio.sleep(0.02)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    grant = await asyncio.wait_for(arbiter.acquire(request("b", 4)), 5)
    assert len(grant.devices) == 4
    await arbiter.close()


async def test_a_device_claimed_elsewhere_meanwhile_is_skipped_at_claim() -> None:
    pool = pool_with(3)
    arbiter = arbiter_for(pool)
    grant = await arbiter.acquire(request("a", 3))
    pool.leave(grant.devices[0])
    assert set(claim(pool, grant)) == set(grant.devices[1:])
    await arbiter.close()


class Broken(RandomSelector):
    def select(self, job_id: str, candidates: list, count: int) -> list[str]:  # type: ignore[override]
        raise ValueError("selector bug")


async def test_a_failing_selector_fails_its_job_not_the_others() -> None:
    pool = pool_with(6)
    arbiter = arbiter_for(pool, grace_s=0.0)
    bad = DeviceRequest("bad", "t", 3, 1, Broken(random.Random(0)))
    results = await asyncio.wait_for(
        asyncio.gather(arbiter.acquire(bad), arbiter.acquire(request("good", 3)),
                       return_exceptions=True),
        5,
    )  # fmt: skip
    assert isinstance(results[0], ValueError)
    assert len(results[1].devices) == 3  # type: ignore[union-attr]
    grant = await asyncio.wait_for(arbiter.acquire(request("later", 3)), 5)
    assert len(grant.devices) == 3, "the arbiter keeps serving"
    await arbiter.close()


async def test_shortfall_and_surplus_say_what_waiting_jobs_lack_and_what_they_leave_idle() -> None:
    """What a deployment's servers tell each other (``federation.placement``): devices
    their waiting jobs lack per task, and idle ones they may send on."""
    pool = pool_with(2)
    add(pool, 3, task="u", start=10)
    arbiter = arbiter_for(pool)
    assert arbiter.shortfall() == {} and arbiter.surplus("t") == 2, "nobody waits: all spare"
    waiting = asyncio.ensure_future(arbiter.acquire(request("a", 5, quorum=5)))
    await asyncio.sleep(0.05)
    assert arbiter.shortfall() == {"t": 3}, "wants 5 of task t, 2 idle"
    assert arbiter.surplus("t") == -3 and arbiter.surplus("u") == 3
    assert arbiter.is_free("d000") and arbiter.is_free("d010")
    add(pool, 3, start=2)
    grant = await asyncio.wait_for(waiting, 5)
    assert arbiter.shortfall() == {}
    assert not any(arbiter.is_free(d) for d in grant.devices), "granted: reserved"
    claim(pool, grant)
    assert not any(arbiter.is_free(d) for d in grant.devices), "claimed: busy"
    assert not arbiter.is_free("nobody")
    await arbiter.close()


# --- joint assignment ----------------------------------------------------------------------


def _history_pool(n: int = 40) -> DevicePool:
    """Devices of spread speed; job ``flat`` has taken about 1 s on every device it tried
    (its work is tiny, its transfer the same everywhere), job ``compute`` 100 s / GFLOP/s."""
    from flotilla.scheduling import RoundOutcome

    pool = DevicePool(time.monotonic)
    speeds = [2.0 ** (i / 8) for i in range(n)]
    for i, gflops in enumerate(speeds):
        pool.seen(DeviceProfile(f"d{i:03d}", tasks=("t",), gflops=gflops, upload_bytes_per_s=1e6))
    tried = [f"d{i:03d}" for i in range(0, n, 5)]
    speed = {f"d{i:03d}": g for i, g in enumerate(speeds)}
    # (compute seconds x GFLOP/s, transfer seconds) of each job's rounds
    for job, work, transfer in (("flat", 0.01, 1.0), ("compute", 100.0, 0.5)):
        pool.record(
            RoundOutcome(
                job,
                1,
                {d: work / speed[d] + transfer for d in tried},
                (),
                selected=tuple(tried),
                compute_s={d: work / speed[d] for d in tried},
            )
        )
    return pool


def _greedy(pool: DevicePool, job: str) -> DeviceRequest:
    from flotilla.scheduling import CostModel, DurationModel, GreedyParams, GreedySelector

    model = DurationModel(pool.history, pool.profile, task="t")
    return DeviceRequest(
        job, "t", 10, 10, GreedySelector(model, CostModel(1.0, 0.0), GreedyParams())
    )


@pytest.mark.parametrize("joint", [True, False])
async def test_contested_devices_go_to_the_job_they_matter_most_to(joint: bool) -> None:
    """``flat`` asks first and is as fast on any device; ``compute`` depends on the fast
    ones. Jointly, ``compute`` gets them; in turn, ``flat`` takes them first."""
    pool = _history_pool()
    arbiter = Arbiter(pool, time.monotonic, grace_s=0.0, poll_s=0.01, joint=joint)
    flat_request = arbiter.acquire(_greedy(pool, "flat"))
    flat, compute = await asyncio.gather(flat_request, arbiter.acquire(_greedy(pool, "compute")))
    assert not set(flat.devices) & set(compute.devices)
    assert flat.contenders == compute.contenders == 2
    assert flat.metrics()["sched_candidates"] == 40  # then compute chose among the rest
    assert compute.metrics()["sched_candidates"] == 30
    fastest = {f"d{i:03d}" for i in range(30, 40)}
    if joint:
        assert set(compute.devices) == fastest
    else:
        assert set(flat.devices) == fastest
    await arbiter.close()


async def test_a_job_deciding_alone_leaves_a_running_jobs_best_devices_idle() -> None:
    """``compute`` holds devices for its running round; ``flat`` then asks alone and takes
    devices ``compute`` will not miss, leaving idle the fast ones it will ask for next."""
    pool = _history_pool(60)
    arbiter = Arbiter(pool, time.monotonic, grace_s=0.0, poll_s=0.01, joint=True)
    compute = await arbiter.acquire(_greedy(pool, "compute"))
    assert claim(pool, compute) == list(compute.devices)  # its round runs on them
    flat = await arbiter.acquire(_greedy(pool, "flat"))
    idle_fast = {f"d{i:03d}" for i in range(40, 50)}  # fastest after compute's own
    assert not idle_fast & set(flat.devices)
    assert len(flat.devices) == 10
    await arbiter.close()
