"""The round engine: one job's rounds, each selected, dispatched, collected and committed whole."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flotilla.aggregation import Aggregator
from flotilla.core.errors import BudgetExhausted, FlotillaError, UpdateRejected
from flotilla.core.records import JobRecord, ParticipationRecord, RoundCommit
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import (
    ModelState,
    TensorSpec,
    decode_state,
    encode_state_parts,
    state_spec,
)
from flotilla.core.update import COMPUTE_METRIC, LOSS_METRIC
from flotilla.engine.backend import Backend, Delivered, Failed, Reported, RoundResult, TrainTask
from flotilla.engine.broadcast import Broadcast, Broadcaster
from flotilla.engine.plan import JobPlan
from flotilla.engine.ports import Blobs, Evaluator, Ledger
from flotilla.scheduling import Arbiter, DevicePool, Grant, Request, RoundOutcome, Selector

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine pacing that is not part of a job's spec."""

    #: Once at least min_quorum devices are idle, wait this long for k before starting.
    selection_grace_s: float = 2.0
    #: Pause before retrying a round that failed to reach quorum.
    retry_pause_s: float = 1.0
    #: How often to look for idle devices while waiting.
    idle_poll_s: float = 0.1
    #: A round whose aggregate is refused this many times in a row fails the job: its
    #: updates keep producing a model that must not be committed (NaN, overflow), and
    #: retrying forever would hold devices other jobs need.
    max_refused_rounds: int = 5


@dataclass(slots=True)
class RoundTally:
    accepted: list[ParticipationRecord] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    durations: dict[str, float] = field(default_factory=dict)
    #: How the arbiter decided this round's devices (recorded with its metrics).
    schedule: dict[str, float] = field(default_factory=dict)
    #: Other numbers recorded with the round's metrics (server-less rounds' agreement).
    metrics: dict[str, float] = field(default_factory=dict)

    def outcome(self, job_id: str, round_no: int, selected: Sequence[str]) -> RoundOutcome:
        """What the scheduler learns from this round."""
        compute, losses, samples = {}, {}, {}
        for rec in self.accepted:
            if COMPUTE_METRIC in rec.metrics:
                compute[rec.device_id] = float(rec.metrics[COMPUTE_METRIC])
            if LOSS_METRIC in rec.metrics:
                losses[rec.device_id] = float(rec.metrics[LOSS_METRIC])
            samples[rec.device_id] = rec.num_samples
        return RoundOutcome(
            job_id,
            round_no,
            dict(self.durations),
            tuple(self.failures),
            selected=tuple(selected),
            compute=compute,
            losses=losses,
            samples=samples,
        )


@dataclass(slots=True)
class JobRunner:
    """Drives one job from its last committed round to its last round."""

    job: JobRecord
    spec: JobSpec
    backend: Backend
    pool: DevicePool
    selector: Selector
    ledger: Ledger
    blobs: Blobs
    evaluator: Evaluator | None
    clock: Callable[[], float]
    config: EngineConfig = field(default_factory=EngineConfig)
    #: Where robust strategies spool a round's updates; required only by them.
    spool_dir: Path | None = None
    #: Shared by every job on ``pool`` so that jobs asking at once are decided jointly;
    #: a job given none gets its own.
    arbiter: Arbiter | None = None
    #: The multiaddrs devices meet at for server-less rounds (``transport = "p2p"``);
    #: None where the backend cannot run them.
    rendezvous: Callable[[], Awaitable[tuple[str, ...]]] | None = None
    #: Peer id -> device id of those of the given devices whose peers the backend knows:
    #: the members a server-less round's group admits (none: no membership check).
    p2p_members: Callable[[Iterable[str]], Mapping[str, str]] | None = None
    _plan: JobPlan = field(init=False)
    _aggregator: Aggregator = field(init=False)
    _layout: tuple[TensorSpec, ...] = field(init=False, default=())
    #: What devices download for the current checkpoint.
    _broadcast: Broadcast = field(init=False, default=Broadcast("", 0))
    _broadcaster: Broadcaster = field(init=False)
    #: Consecutive attempts whose aggregate was refused.
    _refused: int = field(init=False, default=0)
    #: What devices get with every task (fixed for the job).
    _client_config: str = field(init=False, default="")

    async def run(self) -> JobRecord:
        self._plan = JobPlan.from_spec(self.spec)
        if self.arbiter is None:
            self.arbiter = Arbiter(
                self.pool, self.clock, self.config.selection_grace_s, self.config.idle_poll_s
            )
        model = await asyncio.to_thread(self.blobs.get_mapped, self.job.checkpoint_sha256)
        self._layout = state_spec(decode_state(model))  # reads the header only
        del model
        self._aggregator = await self._restored_aggregator()
        if self.job.scheduler_sha256:
            raw = await asyncio.to_thread(self.blobs.get, self.job.scheduler_sha256)
            self._restore_scheduling(raw)
        self._client_config = self._plan.client_config_json(
            self._layout, self._aggregator.client_config()
        )
        comp = self.spec.compression
        self._broadcaster = Broadcaster(self.blobs, self._plan.downlink, comp.downlink_delta)
        if self.job.state == "pending":
            self.job = await self.ledger.set_job_state(self.job.id, "running")
        try:
            await self._prepare_broadcast()
            if self._plan.traits.asynchronous:
                from flotilla.engine.buffered import run_buffered

                await run_buffered(self)
            else:
                from flotilla.engine.p2p_round import run_p2p_round

                p2p = self.spec.aggregation.transport == "p2p"
                while self.job.rounds_committed < self.job.rounds_total:
                    next_round = self.job.rounds_committed + 1
                    if p2p:
                        committed = await run_p2p_round(self, next_round)
                    else:
                        committed = await self.run_round(next_round)
                    if not committed:
                        await asyncio.sleep(self.config.retry_pause_s)
        except BudgetExhausted as exc:
            # The job trained as far as its privacy budget allows: that is its end.
            log.warning("job %s stops: %s", self.job.id, exc)
            self.job = await self.ledger.set_job_state(self.job.id, "completed")
        finally:
            self._aggregator.close()
        return self.job

    async def _restored_aggregator(self) -> Aggregator:
        """A fresh aggregator carrying the state committed with the last round."""
        aggregator = self._plan.aggregator(self._layout, self.spool_dir)
        sha = self.job.aggregator_sha256
        if sha:
            raw = await asyncio.to_thread(self.blobs.get, sha)
            aggregator.restore({k: v.copy() for k, v in decode_state(raw).items()})
        return aggregator

    async def _rollback(self) -> None:
        """Forget whatever a failed round did to the aggregator's state (moments, clip norm)."""
        self._aggregator.close()
        self._aggregator = await self._restored_aggregator()

    async def run_round(self, round_no: int) -> bool:
        """One attempt at a round; True when it committed."""
        global_state = decode_state(
            await asyncio.to_thread(self.blobs.get_mapped, self.job.checkpoint_sha256)
        )
        grant, rate = await self._select()
        # From the claim to the dispatch nothing may await: a claimed device that polls
        # before its task is offered looks idle to the backend, which would free it for
        # another job (one device, two jobs).
        selected = grant.claim()
        if not selected:  # every granted device went away meanwhile
            return False
        started = self.clock()
        task = self._task(round_no, started)
        aggregator = self._aggregator
        aggregator.begin(round_no, global_state)
        del global_state
        tally = RoundTally(schedule=grant.metrics())
        try:
            results = self.backend.dispatch(task, selected)
            async with contextlib.aclosing(results):  # type: ignore[type-var]
                await self._collect(results, task, tally)
        finally:
            for device_id in tally.durations.keys() | set(tally.failures):
                self.pool.release(device_id, self.job.id)
        outcome = tally.outcome(self.job.id, round_no, selected)
        self.pool.record(outcome)
        self.selector.observe(outcome)
        if aggregator.count < min(self.spec.job.min_quorum, len(selected)):
            log.warning(
                "job %s round %d: %d updates, below quorum %d; retrying",
                self.job.id,
                round_no,
                aggregator.count,
                self.spec.job.min_quorum,
            )
            await self._rollback()
            return False
        try:
            await self.commit(round_no, started, tally, rate)
        except UpdateRejected as exc:
            await self._rollback()
            self.refused(round_no, exc)
            return False
        except BaseException:
            await self._rollback()
            raise
        return True

    def _scheduling_state(self) -> bytes:
        """The job's device history and its selector's learned state, as committed."""
        data = {
            "history": self.pool.history.job_state(self.job.id),
            "selector": self.selector.state(),
        }
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    def _restore_scheduling(self, raw: bytes) -> None:
        data = json.loads(raw)
        self.pool.history.restore_job(self.job.id, data["history"])
        self.selector.restore(data.get("selector", {}))

    def refused(self, round_no: int, exc: UpdateRejected) -> None:
        """Count a refused aggregate; too many in a row end the job (FlotillaError)."""
        self._refused += 1
        log.warning("job %s round %d not committed: %s", self.job.id, round_no, exc)
        if self._refused >= self.config.max_refused_rounds:
            raise FlotillaError(
                f"round {round_no} of job {self.job.id} was refused {self._refused} times in "
                f"a row ({exc}); the job fails rather than retry forever"
            )

    async def _select(self) -> tuple[Grant, float]:
        """Devices for a round, from the arbiter; also the sampling rate (privacy)."""
        job = self.spec.job
        factor = job.over_selection
        if self.spec.scheduling.adaptive_over_selection:
            # As production FL does: select k / (1 - expected failure rate), at most the
            # spec's factor (so a bad stretch cannot take the whole fleet).
            expected = self.pool.history.failure_rate(self.job.id)
            factor = min(job.over_selection, 1.0 / max(1.0 - expected, 1e-3))
        want = math.ceil(round(job.clients_per_round * factor, 9))  # 20 x 1.3 is 26
        assert self.arbiter is not None
        grant = await self.arbiter.acquire(
            Request(self.job.id, job.task, want, job.min_quorum, self.selector)
        )
        count = len(grant.devices)
        rate = count / max(len(self.pool.eligible(job.task)), count, 1)
        if self._plan.traits.needs_sampling_rate:
            try:
                self._aggregator.check_budget(rate)  # type: ignore[attr-defined]
            except BaseException:
                self.arbiter.release(grant)
                raise
        return grant, rate

    def _task(self, round_no: int, started: float) -> TrainTask:
        cast = self._broadcast
        return TrainTask(
            job_id=self.job.id,
            round=round_no,
            round_token=uuid.uuid4().hex,
            task=self.spec.job.task,
            config_json=self._client_config,
            model_sha256=cast.sha256,
            model_size=cast.size,
            deadline=started + self.spec.job.round_deadline_s,
            seed=(self.spec.job.seed * 1_000_003 + round_no) % 2**63,
            layout=self._layout,
            codec=self._plan.uplink,
            delta_base_sha256=cast.delta_base_sha256,
            delta_sha256=cast.delta_sha256,
            delta_size=cast.delta_size,
        )

    async def _collect(
        self, results: AsyncIterator[RoundResult], task: TrainTask, tally: RoundTally
    ) -> None:
        want = self.spec.job.clients_per_round
        while self._aggregator.count < want:
            result = await next_result(results, task.deadline - self.clock())
            if result is None:
                return
            self.fold(result, tally)
            del result  # do not hold a model-sized update while waiting for the next one
            await asyncio.sleep(0)  # let other jobs' handlers run between large folds

    def fold(self, result: RoundResult, tally: RoundTally, staleness: int | None = None) -> bool:
        """Hand one result to the aggregator and settle it; True when it was taken."""
        if isinstance(result, Failed | Reported):  # reports belong to server-less rounds
            tally.failures.append(result.device_id)
            return False
        update = result.update
        if not result.wanted():
            # Its sender gave up waiting; the device may already serve another job.
            tally.failures.append(update.device_id)
            return False
        if staleness is None and self._aggregator.count >= self.spec.job.clients_per_round:
            result.settle("round already has enough updates")
            tally.failures.append(update.device_id)
            return False
        try:
            if staleness is None:
                self._aggregator.add(update.delta, float(update.num_samples))
            else:
                self._aggregator.add(  # type: ignore[call-arg]
                    update.delta, float(update.num_samples), staleness=staleness
                )
        except UpdateRejected as exc:
            result.settle(str(exc))
            tally.failures.append(update.device_id)
            return False
        self._accept(result, tally)
        return True

    def _accept(self, result: Delivered, tally: RoundTally) -> None:
        update = result.update
        result.settle(None)
        now = self.clock()
        tally.durations[update.device_id] = result.elapsed_s
        tally.accepted.append(
            ParticipationRecord(
                job_id=self.job.id,
                round=update.round,
                device_id=update.device_id,
                num_samples=update.num_samples,
                started_at=now - result.elapsed_s,
                finished_at=now,
                metrics=dict(update.metrics),
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
        if model is None:
            new_model = await asyncio.to_thread(self._aggregator.finalize)
        else:
            new_model = model
        metrics: dict[str, float] = {**tally.schedule, **tally.metrics}
        if self._plan.traits.needs_sampling_rate:
            metrics["epsilon"] = self._aggregator.spend(rate)  # type: ignore[attr-defined]
        sha, agg_sha = await asyncio.to_thread(self._write_checkpoint, new_model)
        if expect_sha256 and sha != expect_sha256:
            raise UpdateRejected(f"checkpoint {sha[:12]} is not the agreed {expect_sha256[:12]}")
        sched_sha = await asyncio.to_thread(self.blobs.put, self._scheduling_state())
        metrics.update(await self._metrics(new_model, tally))
        del new_model
        participants = _per_device(tally.accepted, round_no)
        commit = RoundCommit(
            job_id=self.job.id,
            round=round_no,
            checkpoint_sha256=sha,
            metrics=metrics,
            started_at=started,
            committed_at=self.clock(),
            participants=participants,
            aggregator_sha256=agg_sha,
            scheduler_sha256=sched_sha,
        )
        self.job = await self.ledger.commit_round(commit)
        self._refused = 0
        await self._prepare_broadcast()
        log.info("job %s round %d committed: %s", self.job.id, round_no, metrics)

    def _write_checkpoint(self, new_model: ModelState) -> tuple[str, str]:
        state = self._aggregator.state()
        agg_sha = self.blobs.put_parts(encode_state_parts(state)) if state else ""
        return self.blobs.put_parts(encode_state_parts(new_model)), agg_sha

    async def _prepare_broadcast(self) -> None:
        """What devices download for the current checkpoint (encoded once per model)."""
        sha = self.job.checkpoint_sha256
        self._broadcast = await asyncio.to_thread(self._broadcaster.prepare, sha)

    async def _metrics(self, model: ModelState, tally: RoundTally) -> dict[str, float]:
        metrics: dict[str, float] = {"updates": float(len(tally.accepted))}
        metrics.update(self._traffic(tally))
        if self.evaluator is not None:
            metrics.update(await asyncio.to_thread(self.evaluator, model))
            return metrics
        total = sum(p.num_samples for p in tally.accepted) or 1
        for name in ("accuracy", "loss"):
            vals = [(p.metrics[name], p.num_samples) for p in tally.accepted if name in p.metrics]
            if vals:
                metrics[name] = sum(v * n for v, n in vals) / total
        return metrics

    def _traffic(self, tally: RoundTally) -> dict[str, float]:
        """Bytes moved for the accepted updates, and how much the uplink codec saved."""
        up = sum(p.metrics.get("bytes_up", 0.0) for p in tally.accepted)
        down = sum(p.metrics.get("bytes_down", 0.0) for p in tally.accepted)
        if not up:
            return {}
        raw = 4.0 * sum(math.prod(s.shape) for s in self._layout) * len(tally.accepted)
        return {"bytes_up": up, "bytes_down": down, "compression_ratio": raw / up}


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


async def next_result(results: AsyncIterator[RoundResult], timeout: float) -> RoundResult | None:
    """The next result within ``timeout`` seconds; None when the stream ends or time is up."""
    if timeout <= 0:
        return None
    try:
        if sys.version_info >= (3, 11):
            # No task per result (wait_for makes one): thousands of results a round.
            async with asyncio.timeout(timeout):
                return await results.__anext__()
        return await asyncio.wait_for(results.__anext__(), timeout=timeout)
    except (StopAsyncIteration, asyncio.TimeoutError):
        return None
