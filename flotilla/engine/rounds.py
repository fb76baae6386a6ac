"""The round engine: one job's rounds, each selected, dispatched, collected and committed whole.

:class:`JobRunner` owns a job's aggregator, checkpoint, selector and scheduling state and
is the public :class:`~flotilla.engine.context.RoundContext` its round mode runs over; the
mode (synchronous, buffered or server-less) is chosen from the job's plan when the runner
is built.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from flotilla.aggregation import Aggregator, FoldsPartials, PrivacyBudgeted, StalenessWeighted
from flotilla.core.errors import BudgetExhausted, FlotillaError, UpdateRejected
from flotilla.core.events import (
    DeviceFailed,
    Fanout,
    JobChanged,
    RoundCommitted,
    RoundRetried,
    StoreCommitted,
    failure_reason,
)
from flotilla.core.records import JobRecord, ParticipationRecord, RoundCommit
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import (
    ModelState,
    TensorSpec,
    decode_state,
    encode_state_parts,
    state_spec,
)
from flotilla.core.update import LOSS_METRIC
from flotilla.core.work import WorkOrder
from flotilla.engine.backend import (
    Arrival,
    Delivered,
    Failed,
    Folded,
    FoldSpec,
    Reported,
    RoundResult,
    TrainTask,
)
from flotilla.engine.broadcast import Broadcast, Broadcaster
from flotilla.engine.buffered import BufferedRounds
from flotilla.engine.context import Dispatched, RoundMode
from flotilla.engine.p2p_round import P2PRounds
from flotilla.engine.plan import JobPlan
from flotilla.engine.ports import Evaluator
from flotilla.engine.secure_round import SecureRounds
from flotilla.engine.services import EngineConfig, EngineServices, P2PPeers
from flotilla.engine.stages import DeviceKeys
from flotilla.engine.sync_round import SyncRounds
from flotilla.engine.tally import RoundTally
from flotilla.scheduling import DeviceRequest, Grant, Lease, Selector

log = logging.getLogger(__name__)


def round_mode(plan: JobPlan, keys: DeviceKeys | None = None) -> RoundMode:
    """The mode a job's rounds run in, from its strategy, transport and privacy
    (``keys``: where secure rounds read devices' identity keys)."""
    if plan.spec.privacy.secure_aggregation:
        return SecureRounds(keys)
    if plan.traits.asynchronous:
        return BufferedRounds()
    if plan.spec.aggregation.transport == "p2p":
        return P2PRounds()
    return SyncRounds()


class JobRunner:
    """Drives one job from its last committed round to its last round."""

    def __init__(
        self,
        job: JobRecord,
        spec: JobSpec,
        services: EngineServices,
        selector: Selector,
        evaluator: Evaluator | None,
        spool_dir: Path | None = None,
    ) -> None:
        """``evaluator``: held-out evaluation of each new model (None, or the spec's
        ``evaluation.server`` off: the devices' metrics); ``spool_dir``: where robust
        strategies spool a round's updates."""
        self._job = job
        self._spec = spec
        self.services = services
        self.selector = selector
        self._evaluator = evaluator if spec.evaluation.server else None
        self._spool_dir = spool_dir
        self._plan = JobPlan.from_spec(spec)
        self._mode = round_mode(self._plan, services.keys)
        comp = spec.compression
        self._broadcaster = Broadcaster(services.blobs, self._plan.downlink, comp.downlink_delta)
        self._aggregator: Aggregator | None = None
        self._layout: tuple[TensorSpec, ...] = ()
        #: What devices download for the current checkpoint.
        self._broadcast = Broadcast("", 0)
        #: Consecutive attempts whose aggregate was refused.
        self._refused = 0
        #: What devices get with every task (fixed for the job).
        self._client_config = ""
        #: Guarded: a consumer that raises is logged, never fails a round.
        self._events = Fanout((services.events,))

    # --- the round context -----------------------------------------------------------

    @property
    def job(self) -> JobRecord:
        return self._job

    @property
    def spec(self) -> JobSpec:
        return self._spec

    @property
    def plan(self) -> JobPlan:
        return self._plan

    @property
    def config(self) -> EngineConfig:
        return self.services.config

    @property
    def p2p(self) -> P2PPeers | None:
        return self.services.p2p

    @property
    def aggregator(self) -> Aggregator:
        if self._aggregator is None:
            raise RuntimeError(f"job {self._job.id} is not running")
        return self._aggregator

    def clock(self) -> float:
        return self.services.clock()

    async def run(self) -> JobRecord:
        blobs = self.services.blobs
        model = await asyncio.to_thread(blobs.get_mapped, self._job.checkpoint_sha256)
        self._layout = state_spec(decode_state(model))  # reads the header only
        del model
        self._aggregator = await self._restored_aggregator()
        if self._job.scheduler_sha256:
            raw = await asyncio.to_thread(blobs.get, self._job.scheduler_sha256)
            self._restore_scheduling(raw)
        self._client_config = self._plan.client_config_json(
            self._layout, self._aggregator.client_config()
        )
        if self._job.state == "pending":
            await self._set_state("running")
        try:
            await self._prepare_broadcast()
            await self._mode.run(self)
        except BudgetExhausted as exc:
            # The job trained as far as its privacy budget allows: that is its end.
            log.warning("job %s stops: %s", self._job.id, exc)
            await self._set_state("completed")
        finally:
            self.aggregator.close()
        return self._job

    async def _set_state(self, state: str) -> None:
        before = self._job.state
        self._job = await self.services.ledger.set_job_state(self._job.id, state)
        if self._job.state != before:
            self._events.emit(JobChanged(self._job.id, self._job.state))

    async def global_model(self) -> ModelState:
        raw = await asyncio.to_thread(self.services.blobs.get_mapped, self._job.checkpoint_sha256)
        return decode_state(raw)

    async def _restored_aggregator(self) -> Aggregator:
        """A fresh aggregator carrying the state committed with the last round."""
        aggregator = self._plan.aggregator(self._layout, self._spool_dir)
        sha = self._job.aggregator_sha256
        if sha:
            raw = await asyncio.to_thread(self.services.blobs.get, sha)
            aggregator.restore({k: v.copy() for k, v in decode_state(raw).items()})
        return aggregator

    async def rollback(self) -> None:
        self.aggregator.close()
        self._aggregator = await self._restored_aggregator()

    def _scheduling_state(self) -> bytes:
        """The job's device history and its selector's learned state, as committed."""
        data = {
            "history": self.services.leases.pool.history.job_state(self._job.id),
            "selector": self.selector.state(),
        }
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    def _restore_scheduling(self, raw: bytes) -> None:
        data = json.loads(raw)
        self.services.leases.pool.history.restore_job(self._job.id, data["history"])
        self.selector.restore(data.get("selector", {}))

    def retried(self, round_no: int, reason: str) -> None:
        self._events.emit(RoundRetried(self._job.id, round_no, reason))

    def refused(self, round_no: int, exc: UpdateRejected) -> None:
        self._refused += 1
        self.retried(round_no, "refused")
        log.warning("job %s round %d not committed: %s", self._job.id, round_no, exc)
        if self._refused >= self.config.max_refused_rounds:
            raise FlotillaError(
                f"round {round_no} of job {self._job.id} was refused {self._refused} times "
                f"in a row ({exc}); the job fails rather than retry forever"
            )

    async def select(self) -> tuple[Grant, float]:
        job, pool = self._spec.job, self.services.leases.pool
        factor = job.over_selection
        if self._spec.scheduling.adaptive_over_selection:
            # As production FL does: select k / (1 - expected failure rate), at most the
            # spec's factor (so a bad stretch cannot take the whole fleet).
            expected = pool.history.failure_rate(self._job.id)
            factor = min(job.over_selection, 1.0 / max(1.0 - expected, 1e-3))
        want = math.ceil(round(job.clients_per_round * factor, 9))  # 20 x 1.3 is 26
        arbiter = self.services.arbiter
        policy = self._spec.eligibility
        grant = await arbiter.acquire(
            DeviceRequest(self._job.id, job.task, want, job.min_quorum, self.selector, policy)
        )
        count = len(grant.devices)
        rate = count / max(len(pool.eligible(job.task, policy)), count, 1)
        aggregator = self.aggregator
        if isinstance(aggregator, PrivacyBudgeted):
            try:
                aggregator.check_budget(rate)
            except BaseException:
                arbiter.release(grant)
                raise
        return grant, rate

    def grant_now(self, want: int) -> Grant | None:
        return self.services.arbiter.grant_now(
            self._job.id, self._spec.job.task, want, self.selector, self._spec.eligibility
        )

    def dispatch(
        self, grant: Grant, make_task: Callable[[Sequence[str]], TrainTask]
    ) -> Lease[Dispatched] | None:
        backend, pool = self.services.backend, self.services.leases.pool

        def start(devices: Sequence[str]) -> Dispatched:
            uplinks = {d: p.upload_bytes_per_s if (p := pool.profile(d)) else 0.0 for d in devices}
            task = self._plan.per_device(make_task(devices), uplinks)
            return Dispatched(task, backend.dispatch(task, devices))

        return self.services.leases.dispatch(grant, start)

    def observe(self, tally: RoundTally, round_no: int, selected: Sequence[str]) -> None:
        outcome = tally.outcome(self._job.id, round_no, selected)
        self.services.leases.pool.record(outcome)
        self.selector.observe(outcome)
        for device_id, reason in tally.reasons.items():
            self._events.emit(DeviceFailed(self._job.id, device_id, reason))

    def task(self, round_no: int, started: float, foldable: bool = False) -> TrainTask:
        cast = self._broadcast
        order = WorkOrder(
            job_id=self._job.id,
            round=round_no,
            round_token=uuid.uuid4().hex,
            task=self._spec.job.task,
            config_json=self._client_config,
            model_sha256=cast.sha256,
            model_size=cast.size,
            deadline=started + self._spec.job.round_deadline_s,
            seed=(self._spec.job.seed * 1_000_003 + round_no) % 2**63,
            delta_base_sha256=cast.delta_base_sha256,
            delta_sha256=cast.delta_sha256,
            delta_size=cast.delta_size,
        )
        plan = self._plan
        fold = None
        if foldable and isinstance(self.aggregator, FoldsPartials):
            agg = self._spec.aggregation
            overrides = self.aggregator.fold_overrides()
            params = json.dumps({**agg.params, **overrides}, sort_keys=True)
            fold = FoldSpec(agg.strategy, params, self._spec.job.clients_per_round)
        return TrainTask(
            order, layout=self._layout, codec=plan.uplink, policy=plan.policy, fold=fold
        )

    def fold(self, result: RoundResult, tally: RoundTally, staleness: int | None = None) -> bool:
        if isinstance(result, Failed):
            tally.fail(result.device_id, failure_reason(result.reason))
            return False
        if isinstance(result, Reported):  # reports belong to server-less rounds
            tally.fail(result.device_id, "refused")
            return False
        if isinstance(result, Folded):
            return self._fold_partials(result, tally, staleness)
        update = result.update
        if not result.wanted():
            # Its sender gave up waiting; the device may already serve another job.
            tally.fail(update.device_id, "gave_up")
            return False
        aggregator = self.aggregator
        if staleness is None and aggregator.count >= self._spec.job.clients_per_round:
            result.settle("round already has enough updates")
            tally.failures.append(update.device_id)  # the scheduler counts it a miss
            tally.stale.append(update.device_id)
            return False
        try:
            if staleness is None:
                aggregator.add(update.delta, float(update.num_samples))
            elif isinstance(aggregator, StalenessWeighted):
                aggregator.add_stale(update.delta, float(update.num_samples), staleness)
            else:
                raise FlotillaError("this strategy does not weight stale updates")
        except UpdateRejected as exc:
            result.settle(str(exc))
            tally.fail(update.device_id, "refused")
            return False
        self._accept(result, tally)
        if staleness:
            tally.stale.append(update.device_id)
        return True

    def _fold_partials(self, result: Folded, tally: RoundTally, staleness: int | None) -> bool:
        """Take updates folded where they trained, all or none: a backend hands over only
        what the round takes, so one that overfills it, or a partial the strategy
        refuses, refuses them all."""
        aggregator = self.aggregator
        members = result.members
        room = self._spec.job.clients_per_round - aggregator.count
        why = ""
        if staleness is not None or not isinstance(aggregator, FoldsPartials):
            why = "this round does not take folded updates"
        elif len(members) > room:
            why = f"{len(members)} folded updates for {room} places"
        elif result.partial.count != len(members):
            why = f"a partial of {result.partial.count} updates names {len(members)} devices"
        else:
            try:
                aggregator.add_partial(result.partial)
            except UpdateRejected as exc:
                why = str(exc)
        if why:
            log.warning("job %s: folded updates refused: %s", self._job.id, why)
            for member in members:
                tally.fail(member.device_id, "refused")
            return False
        now = self.clock()
        for member in members:
            self._record(tally, result.round, member, now)
        return True

    def _accept(self, result: Delivered, tally: RoundTally) -> None:
        update = result.update
        result.settle(None)
        member = Arrival(update.device_id, update.num_samples, update.metrics, result.elapsed_s)
        self._record(tally, update.round, member, self.clock())

    def _record(self, tally: RoundTally, round_no: int, member: Arrival, now: float) -> None:
        """An accepted update, for the round's record and the scheduler."""
        tally.durations[member.device_id] = member.elapsed_s
        tally.accepted.append(
            ParticipationRecord(
                job_id=self._job.id,
                round=round_no,
                device_id=member.device_id,
                num_samples=member.num_samples,
                started_at=now - member.elapsed_s,
                finished_at=now,
                metrics=dict(member.metrics),
            )
        )

    async def commit(
        self,
        round_no: int,
        started: float,
        tally: RoundTally,
        rate: float | None = None,
        model: ModelState | None = None,
        expect_sha256: str = "",
    ) -> None:
        """Commit ``model`` (by default the aggregator's) and the job's state as ``round_no``;
        with ``expect_sha256``, only if the checkpoint hashes to it (else UpdateRejected)."""
        aggregator = self.aggregator
        began = time.perf_counter()
        if model is None:
            new_model = await asyncio.to_thread(aggregator.finalize)
        else:
            new_model = model
        aggregation_s = time.perf_counter() - began
        metrics: dict[str, float] = {**tally.schedule, **tally.metrics}
        if isinstance(aggregator, PrivacyBudgeted):
            metrics["epsilon"] = aggregator.spend(rate)
        sha, size, agg_sha = await asyncio.to_thread(self._write_checkpoint, new_model)
        if expect_sha256 and sha != expect_sha256:
            raise UpdateRejected(f"checkpoint {sha[:12]} is not the agreed {expect_sha256[:12]}")
        sched_sha = await asyncio.to_thread(self.services.blobs.put, self._scheduling_state())
        metrics.update(await self._metrics(new_model, tally, round_no))
        del new_model
        participants = _per_device(tally.accepted, round_no)
        commit = RoundCommit(
            job_id=self._job.id,
            round=round_no,
            checkpoint_sha256=sha,
            checkpoint_size=size,
            metrics=metrics,
            started_at=started,
            committed_at=self.clock(),
            participants=participants,
            aggregator_sha256=agg_sha,
            scheduler_sha256=sched_sha,
            account=tally.account(),
        )
        state = self._job.state
        began = time.perf_counter()
        self._job = await self.services.ledger.commit_round(commit)
        events = self._events
        events.emit(StoreCommitted(time.perf_counter() - began))
        events.emit(
            RoundCommitted(
                self._job.id,
                round_no,
                duration_s=commit.committed_at - started,
                aggregation_s=aggregation_s,
                participants=len(participants),
                job=self._job,
            )
        )
        if self._job.state != state:
            events.emit(JobChanged(self._job.id, self._job.state))
        self._refused = 0
        await self._prepare_broadcast()
        # A short line for the console; the whole dict (scheduler timings too) at debug level.
        headline = "".join(f", {k} {metrics[k]:.4f}" for k in ("accuracy", "loss") if k in metrics)
        job = self._job
        log.info("job %s round %d/%d committed%s", job.id, round_no, job.rounds_total, headline)
        log.debug("job %s round %d metrics: %s", job.id, round_no, metrics)

    def _write_checkpoint(self, new_model: ModelState) -> tuple[str, int, str]:
        """The checkpoint's SHA-256 and size, and the aggregator state's SHA-256."""
        blobs = self.services.blobs
        state = self.aggregator.state()
        agg_sha = blobs.put_parts(encode_state_parts(state)) if state else ""
        parts = encode_state_parts(new_model)
        size = sum(memoryview(p).nbytes for p in parts)
        return blobs.put_parts(parts), size, agg_sha

    async def _prepare_broadcast(self) -> None:
        """What devices download for the current checkpoint (encoded once per model)."""
        sha = self._job.checkpoint_sha256
        self._broadcast = await asyncio.to_thread(self._broadcaster.prepare, sha)

    async def _metrics(
        self, model: ModelState, tally: RoundTally, round_no: int
    ) -> dict[str, float]:
        """The round's counts and traffic, the devices' own numbers (sample-weighted), and
        the held-out scores on the rounds the server evaluates. Without server evaluation,
        ``accuracy`` and ``loss`` are the devices' (``client_accuracy``, ``client_loss``)."""
        metrics: dict[str, float] = {"updates": float(len(tally.accepted))}
        metrics.update(self._traffic(tally))
        reported = _device_means(tally.accepted)
        metrics.update(reported)
        if self._evaluator is None:
            for name in ("accuracy", "loss"):
                if f"client_{name}" in reported:
                    metrics[name] = reported[f"client_{name}"]
            return metrics
        every = self._spec.evaluation.every
        if round_no % every == 0 or round_no >= self._job.rounds_total:
            metrics.update(await asyncio.to_thread(self._evaluator, model))
        return metrics

    def _traffic(self, tally: RoundTally) -> dict[str, float]:
        """Bytes moved for the accepted updates, and how much the uplink codec saved."""
        up = sum(p.metrics.get("bytes_up", 0.0) for p in tally.accepted)
        down = sum(p.metrics.get("bytes_down", 0.0) for p in tally.accepted)
        if not up:
            return {}
        raw = 4.0 * sum(math.prod(s.shape) for s in self._layout) * len(tally.accepted)
        return {"bytes_up": up, "bytes_down": down, "compression_ratio": raw / up}


#: What devices report (name, kept as) that a round keeps, as the sample-weighted mean:
#: their training loss and accuracy, and their own validation (``accuracy`` and ``loss``
#: on the device's held-back examples, kept as ``client_accuracy`` and ``client_loss``).
DEVICE_METRICS = (
    (LOSS_METRIC, LOSS_METRIC),
    ("train_accuracy", "train_accuracy"),
    ("accuracy", "client_accuracy"),
    ("loss", "client_loss"),
)


def _device_means(accepted: Sequence[ParticipationRecord]) -> dict[str, float]:
    """Each of :data:`DEVICE_METRICS` the updates report, weighted by their samples."""
    means: dict[str, float] = {}
    for reported, kept in DEVICE_METRICS:
        vals = [(p.metrics[reported], p.num_samples) for p in accepted if reported in p.metrics]
        weight = sum(n for _, n in vals)
        if vals and weight > 0:
            means[kept] = sum(v * n for v, n in vals) / weight
    return means


def _per_device(
    accepted: list[ParticipationRecord], round_no: int
) -> tuple[ParticipationRecord, ...]:
    """One record per device for the committed round.

    Under FedBuff a fast device can land two updates in one buffer; its samples and bytes
    add up, and its span covers both.
    """
    merged: dict[str, ParticipationRecord] = {}
    for p in accepted:
        prev = merged.get(p.device_id)
        if prev is None:
            merged[p.device_id] = ParticipationRecord(
                p.job_id, round_no, p.device_id, p.num_samples, p.started_at, p.finished_at,
                dict(p.metrics),
            )  # fmt: skip
            continue
        metrics = {**prev.metrics, **p.metrics}
        for key in ("bytes_up", "bytes_down"):
            metrics[key] = prev.metrics.get(key, 0.0) + p.metrics.get(key, 0.0)
        merged[p.device_id] = ParticipationRecord(
            p.job_id, round_no, p.device_id, prev.num_samples + p.num_samples,
            min(prev.started_at, p.started_at), max(prev.finished_at, p.finished_at), metrics,
        )  # fmt: skip
    return tuple(merged.values())
