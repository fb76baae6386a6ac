"""The Gateway, the server's real-device Backend, driven in-process: offers, uploads, verdicts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable

import numpy as np
import pytest

from flotilla.core.device import DeviceProfile
from flotilla.core.errors import StaleRoundError, UpdateRejected
from flotilla.core.tensors import TensorSpec
from flotilla.core.update import Update
from flotilla.core.work import WorkOrder
from flotilla.engine.backend import Delivered, Failed, RoundResult, TrainTask
from flotilla.scheduling import DevicePool, Leases
from flotilla.server.federation.gateway import Gateway

pytestmark = pytest.mark.timeout(10)

TASK = "pkg.mod:Task"
JOB = "job-1"
SHA = "ab" * 32
LAYOUT = (TensorSpec("w", "F32", (2,)),)


class FakeClock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


def _task(token: str = "tok-1", job: str = JOB, round_no: int = 1) -> TrainTask:
    order = WorkOrder(
        job_id=job,
        round=round_no,
        round_token=token,
        task=TASK,
        config_json="{}",
        model_sha256=SHA,
        model_size=123,
        deadline=1e12,
        seed=1,
    )
    return TrainTask(order, layout=LAYOUT)


def _update(device_id: str, task: TrainTask) -> Update:
    delta = {"w": np.ones(2, dtype=np.float32)}
    return Update(task.order.job_id, task.order.round, device_id, num_samples=10, delta=delta)


class Round:
    """The engine's side of one dispatched round: read results one at a time, then close."""

    def __init__(self, gw: Gateway, task: TrainTask, device_ids: Iterable[str]) -> None:
        ids = list(device_ids)
        gw.pool.claim(ids, task.order.job_id)  # the engine claims before it dispatches
        self.task = task
        self.results: AsyncIterator[RoundResult] = gw.dispatch(task, ids)
        self._next: asyncio.Future[RoundResult] | None = None

    async def start(self) -> None:
        """Begin reading, as the engine does right after dispatch."""
        self._next = asyncio.ensure_future(anext(self.results))
        await asyncio.sleep(0)

    async def next(self, timeout: float = 2.0) -> RoundResult:
        fut, self._next = self._next or asyncio.ensure_future(anext(self.results)), None
        return await asyncio.wait_for(fut, timeout)

    async def close(self) -> None:
        if self._next is not None:
            self._next.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await self._next
            self._next = None
        await self.results.aclose()  # type: ignore[attr-defined]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def gw(clock: FakeClock) -> Gateway:
    pool = DevicePool(clock)
    for device_id in "abcdef":
        pool.seen(DeviceProfile(device_id, tasks=(TASK,)))
    return Gateway(pool, clock, Leases(pool))


@pytest.fixture
async def rounds() -> AsyncIterator[list[Round]]:
    opened: list[Round] = []
    yield opened
    for rnd in opened:
        await rnd.close()


async def _open(gw: Gateway, rounds: list[Round], ids: str, task: TrainTask | None = None) -> Round:
    rnd = Round(gw, task or _task(), ids)
    rounds.append(rnd)
    await rnd.start()
    return rnd


async def _submit(gw: Gateway, device_id: str, task: TrainTask) -> asyncio.Task[None]:
    """An agent's upload: checked against the open round, then handed over for a verdict."""
    open_round = gw.expect(device_id, task.order.job_id, task.order.round, task.order.round_token)
    delivery = asyncio.create_task(gw.deliver(open_round, _update(device_id, task), 5.0))
    await asyncio.sleep(0)
    return delivery


def _idle(gw: Gateway) -> set[str]:
    return {p.device_id for p in gw.pool.idle(TASK)}


# --- offers -------------------------------------------------------------------------------------


async def test_dispatch_offers_the_task_to_each_selected_device(
    gw: Gateway, rounds: list[Round]
) -> None:
    rnd = await _open(gw, rounds, "abc")
    assert gw.round_open(rnd.task.order.round_token)
    for device_id in "abc":
        assert await gw.poll(device_id, hold_s=0.01) == rnd.task
        assert gw.pool.busy_with(device_id) == JOB
        assert gw.assigned_model(device_id, SHA)
    assert await gw.poll("d", hold_s=0.01) is None
    assert not gw.assigned_model("d", SHA)
    assert not gw.assigned_model("a", "cd" * 32)
    assert _idle(gw) == {"d", "e", "f"}


async def test_a_waiting_poll_wakes_up_for_an_offer(gw: Gateway, rounds: list[Round]) -> None:
    waiting = asyncio.create_task(gw.poll("a", hold_s=5.0))
    await asyncio.sleep(0.01)
    rnd = await _open(gw, rounds, "a")
    assert await asyncio.wait_for(waiting, 1.0) == rnd.task


async def test_a_poll_with_nothing_to_do_returns_none_after_its_hold(gw: Gateway) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert await gw.poll("a", hold_s=0.05) is None
    assert 0.04 <= loop.time() - start < 1.0


async def test_a_stopping_server_answers_held_polls_at_once_and_every_later_one(
    gw: Gateway,
) -> None:
    """SIGTERM: devices hear "no work" from the server rather than from a cut connection."""
    held = asyncio.create_task(gw.poll("a", hold_s=30.0))
    await asyncio.sleep(0.01)
    gw.close()
    assert await asyncio.wait_for(held, 1.0) is None
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert await gw.poll("b", hold_s=30.0) is None
    assert loop.time() - start < 0.5


# --- uploads and verdicts -----------------------------------------------------------------------


async def test_expect_refuses_rounds_that_are_not_open_for_the_device(
    gw: Gateway, rounds: list[Round]
) -> None:
    rnd = await _open(gw, rounds, "ab")
    task = rnd.task
    await gw.poll("a", 0.01)
    assert gw.expect("a", JOB, 1, task.order.round_token).task == task
    for device_id, job, round_no, token in [
        ("a", JOB, 1, "no-such-token"),
        ("a", "job-2", 1, task.order.round_token),
        ("a", JOB, 2, task.order.round_token),
        ("c", JOB, 1, task.order.round_token),  # not selected for this round
    ]:
        with pytest.raises(StaleRoundError, match="stale round"):
            gw.expect(device_id, job, round_no, token)


async def test_an_accepted_update_reaches_the_engine_once(
    gw: Gateway, rounds: list[Round], clock: FakeClock
) -> None:
    rnd = await _open(gw, rounds, "ab")
    await gw.poll("a", 0.01)
    clock.now += 12.5
    delivery = await _submit(gw, "a", rnd.task)
    result = await rnd.next()
    assert isinstance(result, Delivered)
    assert result.update.device_id == "a" and result.elapsed_s == 12.5
    assert not delivery.done()  # the agent waits for the engine's verdict
    result.settle(None)
    assert await delivery is None
    with pytest.raises(StaleRoundError):  # a second upload for the same round
        gw.expect("a", JOB, 1, rnd.task.order.round_token)


async def test_the_stream_ends_once_every_device_has_reported(
    gw: Gateway, rounds: list[Round]
) -> None:
    rnd = await _open(gw, rounds, "ab")
    await gw.poll("a", 0.01)
    delivery = await _submit(gw, "a", rnd.task)
    result = await rnd.next()
    assert isinstance(result, Delivered)
    result.settle(None)
    await delivery
    gw.fail("b", "left: shutting down")
    assert await rnd.next() == Failed("b", "left: shutting down")
    with pytest.raises(StopAsyncIteration):
        await rnd.next()


async def test_a_refused_update_raises_update_rejected_for_the_agent(
    gw: Gateway, rounds: list[Round]
) -> None:
    rnd = await _open(gw, rounds, "ab")
    for device_id in "ab":
        await gw.poll(device_id, 0.01)
    refused = await _submit(gw, "a", rnd.task)
    result = await rnd.next()
    assert isinstance(result, Delivered)
    result.settle("tensor 'w' contains NaN or Inf")
    with pytest.raises(UpdateRejected, match="NaN or Inf") as info:
        await refused
    assert not isinstance(info.value, StaleRoundError)

    late = await _submit(gw, "b", rnd.task)
    result = await rnd.next()
    assert isinstance(result, Delivered)
    result.settle("stale: round already has enough updates")
    with pytest.raises(StaleRoundError):
        await late


# --- closing a round ----------------------------------------------------------------------------


async def test_closing_the_stream_ends_the_round(gw: Gateway, rounds: list[Round]) -> None:
    # a delivers and is accepted; b and c picked up the task and are uploading;
    # d picked it up and is still training; e never polled.
    rnd = await _open(gw, rounds, "abcde")
    task = rnd.task
    for device_id in "abcd":
        assert await gw.poll(device_id, 0.01) == task
    accepted = await _submit(gw, "a", task)
    result = await rnd.next()
    assert isinstance(result, Delivered)
    result.settle(None)
    await accepted
    open_for_b = gw.expect("b", JOB, 1, task.order.round_token)
    queued_c = await _submit(gw, "c", task)  # waiting in the stream, not yet read

    await rnd.close()

    assert not gw.round_open(task.order.round_token)
    with pytest.raises(StaleRoundError):
        await queued_c
    with pytest.raises(StaleRoundError):
        await gw.deliver(open_for_b, _update("b", task), 1.0)
    with pytest.raises(StaleRoundError):
        gw.expect("d", JOB, 1, task.order.round_token)
    # e did no work: free at once, and its offer is withdrawn.
    assert gw.pool.busy_with("e") is None
    assert await gw.poll("e", 0.01) is None
    assert not gw.assigned_model("e", SHA)


async def test_after_close_a_device_still_training_is_busy_until_it_polls(
    gw: Gateway, rounds: list[Round]
) -> None:
    rnd = await _open(gw, rounds, "ab")
    assert await gw.poll("a", 0.01) == rnd.task
    await rnd.close()
    assert gw.pool.busy_with("a") == JOB  # may still be training: not offered to others yet
    assert gw.pool.busy_with("b") is None
    assert _idle(gw) == {"b", "c", "d", "e", "f"}
    assert await gw.poll("a", 0.01) is None
    assert gw.pool.busy_with("a") is None


async def test_a_late_upload_after_close_frees_the_device(gw: Gateway, rounds: list[Round]) -> None:
    rnd = await _open(gw, rounds, "a")
    await gw.poll("a", 0.01)
    await rnd.close()
    with pytest.raises(StaleRoundError):
        gw.expect("a", JOB, 1, rnd.task.order.round_token)
    assert gw.pool.busy_with("a") is None


# --- devices that give up or go silent ---------------------------------------------------------


async def test_polling_while_owing_an_update_is_abandonment(
    gw: Gateway, rounds: list[Round]
) -> None:
    rnd = await _open(gw, rounds, "ab")
    assert await gw.poll("a", 0.01) == rnd.task
    assert await gw.poll("b", 0.01) == rnd.task
    assert await gw.poll("a", 0.01) is None  # a restarted agent asking for work
    result = await rnd.next()
    assert isinstance(result, Failed) and result.device_id == "a"
    assert "abandon" in result.reason
    assert gw.pool.busy_with("a") is None
    assert gw.pool.busy_with("b") == JOB
    with pytest.raises(StaleRoundError):
        gw.expect("a", JOB, 1, rnd.task.order.round_token)


async def test_a_device_that_has_not_picked_up_its_offer_is_not_abandoning(
    gw: Gateway, rounds: list[Round]
) -> None:
    rnd = await _open(gw, rounds, "a")
    assert await gw.poll("a", 0.01) == rnd.task  # its first poll since the offer: no Failed
    late = await _submit(gw, "a", rnd.task)
    result = await rnd.next()
    assert isinstance(result, Delivered)
    result.settle(None)
    await late


async def test_reap_fails_silent_devices(
    gw: Gateway, rounds: list[Round], clock: FakeClock
) -> None:
    rnd = await _open(gw, rounds, "abc")
    for device_id in "abc":
        await gw.poll(device_id, 0.01)
    clock.now += 20
    gw.pool.touch("b")  # b heartbeats while it trains
    clock.now += 15
    gone = gw.reap(30.0)
    assert sorted(gone) == ["a", "c", "d", "e", "f"]
    failed = {await rnd.next(), await rnd.next()}
    assert failed == {Failed("a", "went silent"), Failed("c", "went silent")}
    assert not gw.pool.is_online("a")
    assert gw.pool.busy_with("a") is None
    assert gw.pool.busy_with("b") == JOB
    with pytest.raises(StaleRoundError):
        gw.expect("a", JOB, 1, rnd.task.order.round_token)
    assert gw.reap(30.0) == []


async def test_reap_withdraws_offers_never_picked_up(
    gw: Gateway, rounds: list[Round], clock: FakeClock
) -> None:
    rnd = await _open(gw, rounds, "a")
    clock.now += 31
    assert gw.reap(30.0) == ["a", "b", "c", "d", "e", "f"]
    assert await rnd.next() == Failed("a", "went silent")
    gw.pool.touch("a")  # it comes back
    assert await gw.poll("a", 0.01) is None


# --- updates whose sender stopped waiting --------------------------------------------------


async def test_an_update_whose_agent_was_told_stale_is_never_aggregated(
    gw: Gateway, rounds: list[Round]
) -> None:
    rnd = await _open(gw, rounds, "ab")
    for device_id in "ab":
        await gw.poll(device_id, 0.01)
    first = await _submit(gw, "a", rnd.task)
    result = await rnd.next()
    assert isinstance(result, Delivered)
    result.settle(None)
    await first
    # The engine is busy elsewhere now; b's upload waits in the stream past its timeout.
    open_round = gw.expect("b", JOB, 1, rnd.task.order.round_token)
    with pytest.raises(StaleRoundError):
        await gw.deliver(open_round, _update("b", rnd.task), 0.01)
    result = await rnd.next()
    assert isinstance(result, Delivered) and not result.wanted(), (
        "the engine would aggregate a refused update"
    )


async def test_an_agent_hanging_up_mid_verdict_frees_its_device_and_withdraws_the_update(
    gw: Gateway, rounds: list[Round]
) -> None:
    rnd = await _open(gw, rounds, "a")
    await gw.poll("a", 0.01)
    delivery = await _submit(gw, "a", rnd.task)
    delivery.cancel()  # the agent's call ended (deadline, reset) before the engine decided
    with pytest.raises(asyncio.CancelledError):
        await delivery
    # The agent polls again: it owes nothing, so another job may claim it ...
    assert await gw.poll("a", 0.01) is None
    assert "a" in _idle(gw)
    other = await _open(gw, rounds, "a", _task("tok-2", job="job-2"))
    assert gw.pool.busy_with("a") == "job-2"
    # ... and the first job, reading the update late, must not fold it.
    result = await rnd.next()
    assert isinstance(result, Delivered) and not result.wanted()
    result.settle(None)  # too late to tell anyone; changes nothing
    assert gw.pool.busy_with("a") == "job-2"
    await other.close()


async def test_a_device_awaiting_a_verdict_is_not_freed_by_a_second_poll(
    gw: Gateway, rounds: list[Round]
) -> None:
    rnd = await _open(gw, rounds, "a")
    await gw.poll("a", 0.01)
    delivery = await _submit(gw, "a", rnd.task)
    # A misbehaving agent polls while its upload still waits for the engine's verdict.
    assert await gw.poll("a", 0.01) is None
    assert gw.pool.busy_with("a") == JOB
    result = await rnd.next()
    assert isinstance(result, Delivered) and result.wanted()
    result.settle(None)
    await delivery


async def test_a_poll_right_after_dispatch_gets_the_offer(gw: Gateway, rounds: list[Round]) -> None:
    rnd = Round(gw, _task(), "a")  # dispatched; the engine has not read the stream yet
    rounds.append(rnd)
    assert await gw.poll("a", 0.01) == rnd.task
    assert gw.pool.busy_with("a") == JOB
