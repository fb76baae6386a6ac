"""The real-device Backend: rounds offered to polling agents, their uploads streamed back.

The gRPC handlers and the round engine meet here. A round is open from ``dispatch`` until
the engine closes its result stream; an update that arrives after that is stale. The
gateway never frees a device itself: it reports each device that owes a job nothing more
to ``events`` (the lease owner, :class:`~flotilla.scheduling.Leases`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flotilla.core.conditions import DeviceConditions
from flotilla.core.eligibility import ineligibility
from flotilla.core.errors import StaleRoundError, UpdateRejected, WireError
from flotilla.core.update import Update
from flotilla.core.work import RoundRef
from flotilla.engine.backend import Delivered, Failed, Reported, RoundResult, TrainTask
from flotilla.scheduling import DeviceEvents, DevicePool
from flotilla.secagg import Stage

log = logging.getLogger(__name__)


@dataclass(slots=True)
class OpenRound:
    task: TrainTask
    started: float
    #: Selected devices that have not reported yet.
    pending: set[str]
    #: Devices whose upload is delivered and waits for the engine's verdict.
    awaiting: set[str] = field(default_factory=set)
    results: asyncio.Queue[RoundResult] = field(default_factory=asyncio.Queue)
    #: Model bytes streamed to each device for this round.
    bytes_down: dict[str, int] = field(default_factory=dict)
    #: Server-less rounds: each device's first report, who was asked to upload the average
    #: of each reported model, and the models whose average has been taken.
    reports: dict[str, Reported] = field(default_factory=dict)
    uploaders: dict[str, str] = field(default_factory=dict)
    uploaded: set[str] = field(default_factory=set)
    #: Set (and replaced) when held reporters should look again: the round closed or an
    #: uploader dropped out.
    news: asyncio.Event = field(default_factory=asyncio.Event)

    def alive(self, device_id: str) -> bool:
        return device_id in self.pending or device_id in self.awaiting

    def announce(self) -> None:
        news, self.news = self.news, asyncio.Event()
        news.set()


class RoundStream:
    """The engine's view of an open round; closing it (or running dry) closes the round."""

    def __init__(self, gateway: Gateway, open_round: OpenRound) -> None:
        self._gateway = gateway
        self._open_round = open_round

    def __aiter__(self) -> RoundStream:
        return self

    async def __anext__(self) -> RoundResult:
        open_round = self._open_round
        if self._gateway.round_open(open_round.task.order.round_token) and (
            open_round.pending or not open_round.results.empty()
        ):
            return await open_round.results.get()
        await self.aclose()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self._gateway.close_round(self._open_round)


@dataclass(slots=True)
class Gateway:
    """Mailboxes for polling agents and the open rounds their uploads belong to."""

    #: Read here (who is online, who serves which job); written only through ``events``.
    pool: DevicePool
    clock: Callable[[], float]
    events: DeviceEvents
    _rounds: dict[str, OpenRound] = field(default_factory=dict)
    _offers: dict[str, TrainTask] = field(default_factory=dict)
    _wakeups: dict[str, asyncio.Event] = field(default_factory=dict)
    #: Every job that had a round here: a job id a device names is only trusted (as a
    #: metric label, say) when it is one of these.
    _jobs: set[str] = field(default_factory=set)
    #: Set by :meth:`close`: the server is stopping, polls are answered
    #: at once.
    _closed: bool = False

    def close(self) -> None:
        """The server is stopping (its jobs' runners are stopped, their rounds closed):
        answer every held poll now, and every later one at once, with no work, so devices
        hear it from the server instead of from a cut connection."""
        self._closed = True
        for wakeup in self._wakeups.values():
            wakeup.set()

    def dispatch(self, task: TrainTask, device_ids: Sequence[str]) -> RoundStream:
        """Offer the task now (so the devices stay claimed); results stream until closed."""
        self._jobs.add(task.order.job_id)
        open_round = OpenRound(task, self.clock(), set(device_ids))
        self._rounds[task.order.round_token] = open_round
        for device_id in device_ids:
            self._offers[device_id] = task
            self._wakeup(device_id).set()
        return RoundStream(self, open_round)

    def close_round(self, open_round: OpenRound) -> None:
        """The engine is done with ``open_round``: later updates are stale, unread ones refused."""
        if self._rounds.get(open_round.task.order.round_token) is not open_round:
            return
        del self._rounds[open_round.task.order.round_token]
        open_round.announce()
        while not open_round.results.empty():
            result = open_round.results.get_nowait()
            if isinstance(result, Delivered):
                result.settle("stale: the round closed before this update was aggregated")
        for device_id in open_round.pending:
            offer = self._offers.get(device_id)
            if offer is not None and offer.order.round_token == open_round.task.order.round_token:
                # Never picked up: the device did no work and is free at once.
                del self._offers[device_id]
                self.events.freed(device_id, open_round.task.order.job_id)
            # Otherwise it is still training: it stays busy until it polls or submits.

    def _wakeup(self, device_id: str) -> asyncio.Event:
        return self._wakeups.setdefault(device_id, asyncio.Event())

    async def poll(self, device_id: str, hold_s: float) -> TrainTask | None:
        """Wait up to ``hold_s`` for work. A polling agent is idle by its own account."""
        self._abandon(device_id)
        offer = self._offers.pop(device_id, None)
        if offer is None and not self._closed:
            wakeup = self._wakeup(device_id)
            wakeup.clear()
            try:
                await asyncio.wait_for(wakeup.wait(), timeout=hold_s)
            except asyncio.TimeoutError:
                return None
            offer = self._offers.pop(device_id, None)
        if offer is not None and offer.order.round_token not in self._rounds:
            self.events.freed(device_id, offer.order.job_id)
            return None
        return None if offer is None else offer.for_device(device_id)

    def _abandon(self, device_id: str) -> None:
        """A device polling while owed an update gave up on it; free it."""
        for open_round in self._rounds.values():
            took_task = self._offers.get(device_id) is not open_round.task
            if device_id in open_round.pending and took_task:
                open_round.pending.discard(device_id)
                open_round.results.put_nowait(Failed(device_id, "agent abandoned the task"))
        self._free_unless_owed(device_id)

    def _free_unless_owed(self, device_id: str) -> None:
        busy = self.pool.busy_with(device_id)
        if busy is not None and not self._owes(device_id):
            self.events.freed(device_id, busy)

    def _owes(self, device_id: str) -> bool:
        return any(device_id in r.pending or device_id in r.awaiting for r in self._rounds.values())

    def offered(self, device_id: str) -> bool:
        """Whether work waits for the device's next poll."""
        return device_id in self._offers

    def known_job(self, job_id: str) -> bool:
        """Whether ``job_id`` ran a round on this gateway (since the server started)."""
        return job_id in self._jobs

    def round_open(self, round_token: str) -> bool:
        return round_token in self._rounds

    def assigned_model(self, device_id: str, sha256: str) -> bool:
        return any(
            device_id in r.pending and sha256 in _downloads(r.task) for r in self._rounds.values()
        )

    def assigned_job(self, device_id: str, sha256: str) -> str:
        """The job whose open round assigned ``sha256`` to the device (empty: none)."""
        for r in self._rounds.values():
            if device_id in r.pending and sha256 in _downloads(r.task):
                return r.task.order.job_id
        return ""

    def count_download(self, device_id: str, sha256: str, nbytes: int) -> None:
        for r in self._rounds.values():
            if device_id in r.pending and sha256 in _downloads(r.task):
                r.bytes_down[device_id] = r.bytes_down.get(device_id, 0) + nbytes

    def expect(self, device_id: str, job_id: str, round_no: int, round_token: str) -> OpenRound:
        """The open round an upload belongs to, or StaleRoundError."""
        open_round = self._rounds.get(round_token)
        if (
            open_round is None
            or open_round.task.order.job_id != job_id
            or open_round.task.order.round != round_no
            or device_id not in open_round.pending
        ):
            self._free_unless_owed(device_id)
            raise StaleRoundError(
                f"stale round: round {round_no} of job {job_id} is not open for this device"
            )
        return open_round

    async def secagg(self, device_id: str, ref: RoundRef, stage: int, body: bytes) -> bytes:
        """Hand a device's message for a stage of the secure round ``ref`` names to the
        round's exchange; its message for the next stage once this one closes. After the
        last stage the device owes the round nothing more."""
        open_round = self.expect(device_id, ref.job_id, ref.round, ref.round_token)
        exchange = open_round.task.secagg
        if exchange is None:
            raise WireError("this round is not a secure round: upload the update instead")
        reply = await exchange.exchange(device_id, stage, body)
        if stage == Stage.UNMASK:
            open_round.pending.discard(device_id)
        return reply

    def report(self, open_round: OpenRound, report: Reported) -> bool:
        """Take a device's report of a server-less round (the engine sees the first one);
        True when this device should upload its group's average now. One device per model
        is asked; if it dies or its upload is refused, the next reporter is."""
        device_id = report.device_id
        first = open_round.reports.get(device_id)
        if first is None:
            report = dataclasses.replace(report, elapsed_s=self.clock() - open_round.started)
            open_round.reports[device_id] = report
            open_round.results.put_nowait(report)
        elif first.model_sha256 != report.model_sha256:
            raise UpdateRejected("a device reports one model per round")
        return self._upload_turn(open_round, device_id)

    @staticmethod
    def _upload_turn(open_round: OpenRound, device_id: str) -> bool:
        sha = open_round.reports[device_id].model_sha256
        if sha in open_round.uploaded:
            return False
        holder = open_round.uploaders.get(sha)
        if holder is None or not open_round.alive(holder):
            open_round.uploaders[sha] = holder = device_id
        return holder == device_id

    async def hold_reporter(self, open_round: OpenRound, device_id: str, hold_s: float) -> bool:
        """Keep a reporter that was not asked to upload until it is (its model's uploader
        dropped out), the round closes, or ``hold_s`` passes; True when it should upload.
        Held instead of polled, so the round's devices are free the moment it commits."""
        loop = asyncio.get_running_loop()
        end = loop.time() + hold_s
        while self.round_open(open_round.task.order.round_token):
            if self._upload_turn(open_round, device_id):
                return True
            left = end - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(open_round.news.wait(), left)
            except asyncio.TimeoutError:
                return False
        return False

    def expect_upload(self, open_round: OpenRound, device_id: str) -> None:
        """In a server-less round only the device asked to upload its model's average may."""
        report = open_round.reports.get(device_id)
        if report is None or open_round.uploaders.get(report.model_sha256) != device_id:
            raise WireError("this round's devices report (ReportAverage); upload only when asked")

    async def deliver(self, open_round: OpenRound, update: Update, timeout_s: float) -> None:
        """Hand a decoded update to the engine and wait for its verdict."""
        if (
            open_round.task.order.round_token not in self._rounds
            or update.device_id not in open_round.pending
        ):
            raise StaleRoundError("stale round: the round closed while the update was uploading")
        loop = asyncio.get_running_loop()
        verdict: asyncio.Future[str | None] = loop.create_future()

        def settle(reason: str | None) -> None:
            if not verdict.done():
                verdict.set_result(reason)

        open_round.pending.discard(update.device_id)
        open_round.awaiting.add(update.device_id)
        open_round.results.put_nowait(
            Delivered(update, self.clock() - open_round.started, settle, lambda: not verdict.done())
        )
        try:
            reason = await asyncio.wait_for(verdict, timeout=timeout_s)
        except asyncio.TimeoutError:
            reason = "stale: the round did not take this update in time"
        finally:
            # Timed out or hung up (handler cancelled): from now on the engine must not
            # fold this update, because the device is free to poll and serve another job.
            if not verdict.done():
                verdict.cancel()
            open_round.awaiting.discard(update.device_id)
        self._settle_upload(open_round, update.device_id, reason is None)
        if reason is None:
            return
        if reason.startswith("stale"):
            raise StaleRoundError(reason)
        raise UpdateRejected(reason)

    @staticmethod
    def _settle_upload(open_round: OpenRound, device_id: str, taken: bool) -> None:
        report = open_round.reports.get(device_id)
        if report is None:
            return
        if taken:
            open_round.uploaded.add(report.model_sha256)
        elif open_round.uploaders.get(report.model_sha256) == device_id:
            del open_round.uploaders[report.model_sha256]  # the next reporter of it is asked
            open_round.announce()

    def fail(self, device_id: str, reason: str) -> None:
        """A device will report nothing more to any round it owes (it left or went silent)."""
        for open_round in self._rounds.values():
            if device_id in open_round.pending:
                open_round.pending.discard(device_id)
                open_round.results.put_nowait(Failed(device_id, reason))
                # Nothing of it waits to be folded, so it is free now. (A silent device
                # whose update is already queued stays its job's until that job lets go.)
                self.events.freed(device_id, open_round.task.order.job_id)
                open_round.announce()  # it may have been asked to upload a model
        self._offers.pop(device_id, None)

    def give_up(self, device_id: str, ref: RoundRef, reason: str) -> None:
        """The device will not finish the round ``ref`` names (its conditions changed, its
        training failed): a dropout now, not at the deadline. StaleRoundError when that round
        does not expect it."""
        open_round = self.expect(device_id, ref.job_id, ref.round, ref.round_token)
        open_round.pending.discard(device_id)
        open_round.results.put_nowait(Failed(device_id, reason))
        self.events.freed(device_id, open_round.task.order.job_id)
        open_round.announce()

    def wake(self, device_id: str) -> None:
        """End the device's held poll now (empty-handed): its next call comes at once."""
        self._offers.pop(device_id, None)
        self._wakeup(device_id).set()

    def owed(self, device_id: str) -> list[RoundRef]:
        """The open rounds still waiting for this device's update."""
        return [r.task.order.ref for r in self._rounds.values() if device_id in r.pending]

    def judge(self, device_id: str, conditions: DeviceConditions) -> list[RoundRef]:
        """Give up, for the device, every round it owes (or was offered) whose job's
        eligibility ``conditions`` no longer meet: a dropout with reason ``conditions``,
        whether or not the device itself noticed. The rounds given up."""
        given_up = []
        for open_round in list(self._rounds.values()):
            policy = open_round.task.policy
            if policy is None or device_id not in open_round.pending:
                continue
            why = ineligibility(policy, None, conditions)
            if why is None:
                continue
            order = open_round.task.order
            offer = self._offers.get(device_id)
            if offer is not None and offer.order.round_token == order.round_token:
                del self._offers[device_id]  # offered, not yet picked up: withdrawn
            self.give_up(device_id, order.ref, f"conditions: {why}")
            given_up.append(order.ref)
        return given_up

    def leave(self, device_id: str, reason: str) -> None:
        """The device signed off: it fails what it owes and goes offline, free of any job."""
        self.fail(device_id, f"left: {reason}")
        self.events.left(device_id)

    def reap(self, liveness_s: float) -> list[str]:
        gone = self.pool.expire(liveness_s)
        for device_id in gone:
            self.fail(device_id, "went silent")
        return gone


def _downloads(task: TrainTask) -> tuple[str, ...]:
    """The blobs a device working on ``task`` may fetch: the model, or its delta."""
    return (
        (task.order.model_sha256, task.order.delta_sha256)
        if task.order.delta_sha256
        else (task.order.model_sha256,)
    )
