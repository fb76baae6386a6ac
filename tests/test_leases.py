"""Device leases: one owner of occupancy, claim-and-dispatch in one call, every release.

The source check keeps every claim and release of the pool inside
``flotilla/scheduling/leases.py``. The contract tests run the server's Gateway and the
simulator's SimBackend through the same release scenarios and assert that each device
ends free, freed through the lease owner (a backend only reports the event).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flotilla.core.blobstore import BlobStore
from flotilla.core.device import DeviceProfile
from flotilla.core.errors import StaleRoundError
from flotilla.core.tensors import TensorSpec, encode_state
from flotilla.core.update import Update
from flotilla.core.work import WorkOrder
from flotilla.engine.backend import Delivered, Failed, ResultStream, RoundResult, TrainTask
from flotilla.scheduling import Arbiter, DevicePool, Grant, Lease, Leases, RoundOutcome
from flotilla.server.federation.gateway import Gateway
from flotilla.simulation.backend import SimBackend
from flotilla.simulation.fleet import Fleet
from flotilla.simulation.population import AvailabilitySection, PopulationSection, draw_devices
from flotilla.simulation.training import ClientResult

pytestmark = pytest.mark.timeout(20)

ROOT = Path(__file__).resolve().parents[1] / "flotilla"
LEASE_MODULE = ROOT / "scheduling" / "leases.py"
POOL_MODULE = ROOT / "scheduling" / "pool.py"
TASK = "pkg.mod:Task"
JOB = "job-1"
LAYOUT = (TensorSpec("w", "F32", (2,)),)


# --- nothing outside the lease module claims or releases ------------------------------------


def occupancy_writes(source: str) -> list[str]:
    """Calls of ``claim``/``release`` on something named like a pool, and writes of a
    ``busy_with`` attribute, as ``line: code``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("claim", "release")
            and "pool" in ast.unparse(node.func.value).lower()
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr == "busy_with":
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_source_check_catches_each_way_of_writing_occupancy() -> None:
    source = (
        "runner.pool.release(d, job)\n"
        "self.pool.claim(ids, job)\n"
        "pool.release(d, job)\n"
        "state.busy_with = None\n"
        "self._budget.release(n)\n"  # not a pool: allowed
        "arbiter.release(grant)\n"
    )
    assert sorted(w.split(":")[0] for w in occupancy_writes(source)) == ["1", "2", "3", "4"]


def test_nothing_outside_the_lease_module_claims_or_releases_a_device() -> None:
    allowed = {LEASE_MODULE, POOL_MODULE}  # the owner, and the pool that stores the flag
    offenders = {
        str(path.relative_to(ROOT.parent)): writes
        for path in sorted(ROOT.rglob("*.py"))
        if path not in allowed and (writes := occupancy_writes(path.read_text()))
    }
    assert offenders == {}


def test_only_the_lease_module_calls_the_pools_claim_and_release() -> None:
    tree = ast.parse(LEASE_MODULE.read_text())
    calls = {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and ast.unparse(node.func.value) == "self.pool"
    }
    assert {"claim", "release", "leave"} <= calls


# --- leases ---------------------------------------------------------------------------------


class Pick:
    """A selector that picks the named devices, in that order."""

    def __init__(self, ids: Iterable[str]) -> None:
        self.ids = list(ids)

    def select(self, job_id: str, candidates: Sequence[DeviceProfile], count: int) -> list[str]:
        free = {c.device_id for c in candidates}
        return [d for d in self.ids if d in free][:count]

    def observe(self, outcome: RoundOutcome) -> None:
        return None

    def state(self) -> dict[str, Any]:
        return {}

    def restore(self, state: Mapping[str, Any]) -> None:
        return None


class Recorder(Leases):
    """The lease owner, keeping each event a backend reports."""

    def __init__(self, pool: DevicePool) -> None:
        super().__init__(pool)
        self.events: list[tuple[str, ...]] = []

    def freed(self, device_id: str, job_id: str) -> None:
        self.events.append(("freed", device_id, job_id))
        super().freed(device_id, job_id)

    def left(self, device_id: str) -> None:
        self.events.append(("left", device_id))
        super().left(device_id)


def pool_of(ids: str, clock: Any = None) -> DevicePool:
    pool = DevicePool(clock or (lambda: 0.0))
    for device_id in ids:
        pool.seen(DeviceProfile(device_id, tasks=(TASK,)))
    return pool


def grant(pool: DevicePool, ids: str, job: str = JOB) -> Grant:
    got = Arbiter(pool, lambda: 0.0).grant_now(job, TASK, len(ids), Pick(ids))
    assert got is not None
    return got


def test_dispatch_claims_and_starts_in_one_call() -> None:
    pool = pool_of("abcd")
    seen: dict[str, str | None] = {}

    def start(devices: Sequence[str]) -> str:
        seen.update({d: pool.busy_with(d) for d in devices})
        return "stream"

    lease = Leases(pool).dispatch(grant(pool, "abc"), start)
    assert lease is not None and lease.work == "stream"
    assert lease.devices == ("a", "b", "c")
    assert seen == {"a": JOB, "b": JOB, "c": JOB}, "busy when the backend gets them"
    assert [p.device_id for p in pool.idle(TASK)] == ["d"]


def test_dispatch_skips_devices_gone_or_taken_and_starts_nothing_for_none() -> None:
    pool = pool_of("abc")
    leases = Leases(pool)
    first = grant(pool, "ab")
    second = grant(pool, "c")
    leases.left("a")
    other = leases.dispatch(second, list)
    assert other is not None
    lease = leases.dispatch(first, list)
    assert lease is not None and lease.devices == ("b",)
    assert leases.dispatch(first, list) is None, "a grant is redeemed once"
    starts: list[Sequence[str]] = []
    pool.seen(DeviceProfile("a", tasks=(TASK,)))
    late = grant(pool, "a")
    leases.left("a")
    assert leases.dispatch(late, starts.append) is None
    assert starts == [], "nothing to dispatch: the backend is not called"


def test_a_dispatch_that_raises_frees_its_devices() -> None:
    pool = pool_of("ab")

    def broken(devices: Sequence[str]) -> None:
        raise RuntimeError("backend down")

    with pytest.raises(RuntimeError, match="backend down"):
        Leases(pool).dispatch(grant(pool, "ab"), broken)
    assert [p.device_id for p in pool.idle(TASK)] == ["a", "b"]


def test_a_released_grant_dispatches_nothing() -> None:
    pool = pool_of("ab")
    arbiter = Arbiter(pool, lambda: 0.0)
    got = arbiter.grant_now(JOB, TASK, 2, Pick("ab"))
    assert got is not None
    assert arbiter.idle(TASK) == [], "reserved for the job"
    arbiter.release(got)
    assert Leases(pool).dispatch(got, list) is None
    assert len(arbiter.idle(TASK)) == 2


def test_a_lease_frees_only_its_own_devices_and_only_from_its_job() -> None:
    pool = pool_of("abc")
    leases = Leases(pool)
    mine = leases.dispatch(grant(pool, "ab"), list)
    theirs = leases.dispatch(grant(pool, "c", job="job-2"), list)
    assert mine is not None and theirs is not None
    mine.free(["a", "c"])  # c is not this lease's
    assert pool.busy_with("a") is None
    assert pool.busy_with("b") == JOB
    assert pool.busy_with("c") == "job-2"
    leases.freed("b", "job-2")  # an event for the wrong job changes nothing
    assert pool.busy_with("b") == JOB


def test_a_device_that_leaves_goes_offline_free_of_its_job_and_comes_back_idle() -> None:
    pool = pool_of("ab")
    leases = Leases(pool)
    leases.dispatch(grant(pool, "a"), list)
    leases.left("a")
    assert not pool.is_online("a")
    assert leases.holder("a") is None
    pool.touch("a")
    assert [p.device_id for p in pool.idle(TASK)] == ["a", "b"]


def test_going_offline_alone_keeps_a_device_its_jobs() -> None:
    """The pool's own leave only marks the device offline: freeing is the lease owner's."""
    pool = pool_of("a")
    Leases(pool).dispatch(grant(pool, "a"), list)
    pool.leave("a")
    assert pool.busy_with("a") == JOB


# --- one contract, two backends -------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """A backend with devices a, b, c, and the engine's side of one round on it."""

    recorder: Recorder
    pool: DevicePool
    lease: Lease[ResultStream]
    task: TrainTask

    async def begin(self, ids: str, pick_up: bool = True) -> None:
        raise NotImplementedError

    async def finish(self, device_id: str) -> None:
        """The device completes its training and uploads."""
        raise NotImplementedError

    async def finish_late(self, device_id: str) -> None:
        """As :meth:`finish`, for a round the engine already closed."""
        raise NotImplementedError

    async def silence(self, device_id: str) -> None:
        """The device stops speaking mid-round (crash, dropout, battery)."""
        raise NotImplementedError

    def dispatch(self, backend: Any, ids: str) -> None:
        task = self.task
        lease = self.recorder.dispatch(grant(self.pool, ids), lambda d: backend.dispatch(task, d))
        assert lease is not None
        self.lease = lease

    async def next(self) -> RoundResult:
        return await asyncio.wait_for(anext(self.lease.work), 5.0)

    async def close(self) -> None:
        await self.lease.work.aclose()

    def freed(self) -> set[str]:
        return {e[1] for e in self.recorder.events if e[0] == "freed" and e[2] == JOB}


class GatewayHarness(Harness):
    def __init__(self, tmp_path: Path) -> None:
        self.clock = FakeClock()
        self.pool = pool_of("abc", self.clock)
        self.recorder = Recorder(self.pool)
        self.gw = Gateway(self.pool, self.clock, self.recorder)
        self.task = _task("ab" * 32)
        self.uploads: list[asyncio.Task[None]] = []

    async def begin(self, ids: str, pick_up: bool = True) -> None:
        self.dispatch(self.gw, ids)
        for device_id in ids if pick_up else "":
            assert await self.gw.poll(device_id, 0.01) == self.task

    async def finish(self, device_id: str) -> None:
        rnd = self.gw.expect(device_id, JOB, 1, self.task.order.round_token)
        update = Update(JOB, 1, device_id, 10, {"w": np.ones(2, dtype=np.float32)})
        self.uploads.append(asyncio.ensure_future(self.gw.deliver(rnd, update, 5.0)))
        await asyncio.sleep(0)

    async def finish_late(self, device_id: str) -> None:
        with pytest.raises(StaleRoundError):
            self.gw.expect(device_id, JOB, 1, self.task.order.round_token)

    async def silence(self, device_id: str) -> None:
        self.clock.now += 31
        for other in "abc":
            if other != device_id:
                self.pool.touch(other)
        assert self.gw.reap(30.0) == [device_id]


class FakeDevice:
    def __init__(self, index: int) -> None:
        self.index = index

    def round_seconds(self, *args: float) -> float:
        return 0.05

    def compute_seconds(self, *args: float) -> float:
        return 0.01


class FakeFleet:
    def __init__(self) -> None:
        self.devices = {d: FakeDevice(i) for i, d in enumerate("abc")}
        self.offline_at: dict[str, float] = {}

    def online_until(self, device_id: str) -> float:
        return self.offline_at.get(device_id, math.inf)


class FakeShards:
    def num_train(self, data: Any, client: int) -> int:
        return 10


class FakeTrainer:
    shards = FakeShards()

    def train(self, model: Any, clients: Sequence[int], *args: Any) -> list[ClientResult]:
        return [ClientResult(10, {}, {"w": np.ones(2, dtype=np.float32)}) for _ in clients]


class SimHarness(Harness):
    def __init__(self, tmp_path: Path) -> None:
        self.pool = pool_of("abc")
        self.recorder = Recorder(self.pool)
        self.fleet = FakeFleet()
        blobs = BlobStore(tmp_path / "blobs")
        sha = blobs.put(encode_state({"w": np.zeros(2, dtype=np.float32)}))
        population = PopulationSection(clients=3, dropout_detect_s=0.05)
        self.backend = SimBackend(
            self.fleet,  # type: ignore[arg-type]
            self.recorder,
            blobs,
            {TASK: FakeTrainer()},  # type: ignore[dict-item]
            population,
            0,
            tmp_path / "clients",
        )
        self.task = _task(sha)
        self.finishing: set[str] = set()

    async def begin(self, ids: str, pick_up: bool = True) -> None:
        self.dispatch(self.backend, ids)

    async def finish(self, device_id: str) -> None:
        await asyncio.sleep(0.06)  # its round takes 0.05 s

    async def finish_late(self, device_id: str) -> None:
        await asyncio.sleep(0.06)

    async def silence(self, device_id: str) -> None:
        raise NotImplementedError("set before dispatch: see dropout_before")

    def dropout_before(self, device_id: str) -> None:
        self.fleet.offline_at[device_id] = asyncio.get_running_loop().time()


def _task(sha: str) -> TrainTask:
    order = WorkOrder(
        job_id=JOB,
        round=1,
        round_token="tok-1",
        task=TASK,
        config_json="{}",
        model_sha256=sha,
        model_size=8,
        deadline=1e12,
        seed=1,
    )
    return TrainTask(order, layout=LAYOUT)


@pytest.fixture(params=["gateway", "sim"])
async def harness(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Harness]:
    made: Harness = (GatewayHarness if request.param == "gateway" else SimHarness)(tmp_path)
    yield made
    if hasattr(made, "lease"):
        await made.close()
    for upload in getattr(made, "uploads", []):
        upload.cancel()
        with contextlib.suppress(BaseException):
            await upload


async def test_settled_updates_leave_their_devices_free_once_the_round_lets_go(
    harness: Harness,
) -> None:
    await harness.begin("ab")
    for device_id in "ab":
        await harness.finish(device_id)
    done = set()
    for _ in "ab":
        result = await harness.next()
        assert isinstance(result, Delivered)
        result.settle(None)
        done.add(result.update.device_id)
    await asyncio.sleep(0)
    harness.lease.free(done)  # the engine's round end
    assert harness.pool.busy_with("a") is None and harness.pool.busy_with("b") is None
    assert harness.freed() == {"a", "b"}


async def test_an_update_after_its_round_closed_is_stale_and_its_device_free(
    harness: Harness,
) -> None:
    await harness.begin("a")
    await harness.close()
    await harness.finish_late("a")
    assert harness.pool.busy_with("a") is None
    assert harness.freed() == {"a"}


async def test_a_device_that_goes_silent_fails_its_round_and_is_free(harness: Harness) -> None:
    if isinstance(harness, SimHarness):
        harness.dropout_before("a")  # a simulated device's dropout is drawn at dispatch
        await harness.begin("ab")
    else:
        await harness.begin("ab")
        await harness.silence("a")
    result = await harness.next()
    assert isinstance(result, Failed) and result.device_id == "a"
    assert harness.pool.busy_with("a") is None
    assert harness.pool.busy_with("b") == JOB, "the others still train"
    assert harness.freed() == {"a"}


# --- the gateway's own ways of letting go (a simulated device always picks up) ----------------


@pytest.fixture
async def gw_harness(tmp_path: Path) -> AsyncIterator[GatewayHarness]:
    made = GatewayHarness(tmp_path)
    yield made
    if hasattr(made, "lease"):
        await made.close()
    for upload in made.uploads:
        upload.cancel()
        with contextlib.suppress(BaseException):
            await upload


async def test_an_offer_never_picked_up_is_freed_when_its_round_closes(
    gw_harness: GatewayHarness,
) -> None:
    await gw_harness.begin("ab", pick_up=False)
    await gw_harness.close()
    assert gw_harness.pool.busy_with("a") is None and gw_harness.pool.busy_with("b") is None
    assert gw_harness.freed() == {"a", "b"}


async def test_a_device_abandoning_its_task_fails_it_and_is_free(
    gw_harness: GatewayHarness,
) -> None:
    await gw_harness.begin("a")
    assert await gw_harness.gw.poll("a", 0.01) is None  # polls again instead of uploading
    assert await gw_harness.next() == Failed("a", "agent abandoned the task")
    assert gw_harness.pool.busy_with("a") is None
    assert gw_harness.freed() == {"a"}


async def test_a_device_that_leaves_fails_its_round_and_goes_offline_free(
    gw_harness: GatewayHarness,
) -> None:
    await gw_harness.begin("ab")
    gw_harness.gw.leave("a", "shutting down")
    assert await gw_harness.next() == Failed("a", "left: shutting down")
    assert not gw_harness.pool.is_online("a")
    assert gw_harness.pool.busy_with("a") is None
    assert ("left", "a") in gw_harness.recorder.events
    gw_harness.pool.touch("a")
    assert "a" in {p.device_id for p in gw_harness.pool.idle(TASK)}


async def test_hanging_up_mid_verdict_frees_the_device_and_withdraws_the_update(
    gw_harness: GatewayHarness,
) -> None:
    await gw_harness.begin("a")
    await gw_harness.finish("a")
    upload = gw_harness.uploads.pop()
    upload.cancel()  # the agent's call ended before the engine decided
    with pytest.raises(asyncio.CancelledError):
        await upload
    assert await gw_harness.gw.poll("a", 0.01) is None
    assert gw_harness.pool.busy_with("a") is None
    assert gw_harness.freed() == {"a"}
    result = await gw_harness.next()
    assert isinstance(result, Delivered) and not result.wanted()


async def test_a_simulated_device_going_offline_is_freed_of_its_job() -> None:
    """The virtual fleet's availability reaches the pool through the lease owner too."""
    availability = AvailabilitySection("exponential", mean_on_s=0.05, mean_off_s=0.05)
    population = PopulationSection(clients=6, availability=availability)
    pool = DevicePool(asyncio.get_running_loop().time)
    recorder = Recorder(pool)
    fleet = Fleet(draw_devices(population, 0), (TASK,), availability, 0, recorder)
    fleet.start()
    try:
        deadline = time.monotonic() + 5
        while not (online := [p.device_id for p in pool.idle(TASK)]):
            assert time.monotonic() < deadline, "no device ever came online"
            await asyncio.sleep(0.01)
        got = Arbiter(pool, lambda: 0.0).grant_now(JOB, TASK, 1, Pick(online))
        assert got is not None
        lease = recorder.dispatch(got, list)
        assert lease is not None
        (device_id,) = lease.devices
        while ("left", device_id) not in recorder.events:
            assert time.monotonic() < deadline, "the device never went offline"
            await asyncio.sleep(0.01)
        assert not pool.is_online(device_id)
        assert pool.busy_with(device_id) is None
    finally:
        fleet.stop()
