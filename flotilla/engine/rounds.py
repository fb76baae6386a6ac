"""The round engine: one job's rounds, each selected, dispatched, collected and committed whole."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from flotilla.aggregation import StreamingFedAvg
from flotilla.core.errors import UpdateRejected
from flotilla.core.records import JobRecord, ParticipationRecord, RoundCommit
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import ModelState, TensorSpec, decode_state, encode_state, state_spec
from flotilla.engine.backend import Backend, Failed, RoundResult, TrainTask
from flotilla.engine.ports import Blobs, Evaluator, Ledger
from flotilla.scheduling import DevicePool, RoundOutcome, Selector

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


@dataclass(slots=True)
class RoundTally:
    accepted: list[ParticipationRecord] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    durations: dict[str, float] = field(default_factory=dict)


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
    _layout: tuple[TensorSpec, ...] = field(init=False, default=())

    async def run(self) -> JobRecord:
        model = decode_state(await asyncio.to_thread(self.blobs.get, self.job.checkpoint_sha256))
        self._layout = state_spec(model)
        del model
        if self.job.state == "pending":
            self.job = await self.ledger.set_job_state(self.job.id, "running")
        while self.job.rounds_committed < self.job.rounds_total:
            committed = await self.run_round(self.job.rounds_committed + 1)
            if not committed:
                await asyncio.sleep(self.config.retry_pause_s)
        return self.job

    async def run_round(self, round_no: int) -> bool:
        """One attempt at a round; True when it committed."""
        selected = await self._select()
        started = self.clock()
        task = self._task(round_no, started)
        aggregator = StreamingFedAvg(self._layout, self.spec.aggregation.server_lr)
        tally = RoundTally()
        try:
            results = self.backend.dispatch(task, selected)
            async with contextlib.aclosing(results):  # type: ignore[type-var]
                await self._collect(results, task, aggregator, tally)
        finally:
            for device_id in tally.durations.keys() | set(tally.failures):
                self.pool.release(device_id, self.job.id)
        self.selector.observe(
            RoundOutcome(self.job.id, round_no, dict(tally.durations), tuple(tally.failures))
        )
        if aggregator.count < min(self.spec.job.min_quorum, len(selected)):
            log.warning(
                "job %s round %d: %d updates, below quorum %d; retrying",
                self.job.id,
                round_no,
                aggregator.count,
                self.spec.job.min_quorum,
            )
            return False
        try:
            await self._commit(round_no, started, aggregator, tally)
        except UpdateRejected as exc:
            log.warning("job %s round %d not committed: %s", self.job.id, round_no, exc)
            return False
        return True

    async def _select(self) -> list[str]:
        job = self.spec.job
        want = math.ceil(job.clients_per_round * job.over_selection)
        grace_until: float | None = None
        while True:
            idle = self.pool.idle(job.task)
            if len(idle) >= want:
                break
            if len(idle) >= job.min_quorum:
                now = self.clock()
                grace_until = grace_until or now + self.config.selection_grace_s
                if now >= grace_until:
                    break
            await asyncio.sleep(self.config.idle_poll_s)
        chosen = self.selector.select(self.job.id, idle, want)
        self.pool.claim(chosen, self.job.id)
        return chosen

    def _task(self, round_no: int, started: float) -> TrainTask:
        config = {"train": self.spec.to_dict()["train"], "data": self.spec.to_dict()["data"]}
        return TrainTask(
            job_id=self.job.id,
            round=round_no,
            round_token=uuid.uuid4().hex,
            task=self.spec.job.task,
            config_json=json.dumps(config, sort_keys=True),
            model_sha256=self.job.checkpoint_sha256,
            model_size=self.blobs.path(self.job.checkpoint_sha256).stat().st_size,
            deadline=started + self.spec.job.round_deadline_s,
            seed=(self.spec.job.seed * 1_000_003 + round_no) % 2**63,
            layout=self._layout,
        )

    async def _collect(
        self,
        results: AsyncIterator[RoundResult],
        task: TrainTask,
        aggregator: StreamingFedAvg,
        tally: RoundTally,
    ) -> None:
        want = self.spec.job.clients_per_round
        while aggregator.count < want:
            remaining = task.deadline - self.clock()
            if remaining <= 0:
                return
            try:
                result = await asyncio.wait_for(results.__anext__(), timeout=remaining)
            except (StopAsyncIteration, asyncio.TimeoutError):
                return
            self._fold(result, aggregator, tally)
            await asyncio.sleep(0)  # let other jobs' handlers run between large folds

    def _fold(self, result: RoundResult, aggregator: StreamingFedAvg, tally: RoundTally) -> None:
        if isinstance(result, Failed):
            tally.failures.append(result.device_id)
            return
        update = result.update
        if aggregator.count >= self.spec.job.clients_per_round:
            result.settle("round already has enough updates")
            tally.failures.append(update.device_id)
            return
        try:
            aggregator.add(update.delta, float(update.num_samples))
        except UpdateRejected as exc:
            result.settle(str(exc))
            tally.failures.append(update.device_id)
            return
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

    async def _commit(
        self, round_no: int, started: float, aggregator: StreamingFedAvg, tally: RoundTally
    ) -> None:
        sha, new_model = await asyncio.to_thread(self._write_checkpoint, aggregator)
        metrics = await self._metrics(new_model, tally)
        del new_model
        commit = RoundCommit(
            job_id=self.job.id,
            round=round_no,
            checkpoint_sha256=sha,
            metrics=metrics,
            started_at=started,
            committed_at=self.clock(),
            participants=tuple(tally.accepted),
        )
        self.job = await self.ledger.commit_round(commit)
        log.info("job %s round %d committed: %s", self.job.id, round_no, metrics)

    def _write_checkpoint(self, aggregator: StreamingFedAvg) -> tuple[str, ModelState]:
        current = decode_state(self.blobs.get(self.job.checkpoint_sha256))
        new_model = aggregator.finalize(current)
        del current
        return self.blobs.put(encode_state(new_model)), new_model

    async def _metrics(self, model: ModelState, tally: RoundTally) -> dict[str, float]:
        metrics: dict[str, float] = {"updates": float(len(tally.accepted))}
        if self.evaluator is not None:
            metrics.update(await asyncio.to_thread(self.evaluator, model))
            return metrics
        total = sum(p.num_samples for p in tally.accepted) or 1
        for name in ("accuracy", "loss"):
            vals = [(p.metrics[name], p.num_samples) for p in tally.accepted if name in p.metrics]
            if vals:
                metrics[name] = sum(v * n for v, n in vals) / total
        return metrics
