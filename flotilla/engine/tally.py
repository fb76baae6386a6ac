"""What every round mode shares: a round's tally and reading its result stream."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from flotilla.core.records import ParticipationRecord
from flotilla.core.update import COMPUTE_METRIC, LOSS_METRIC
from flotilla.engine.backend import RoundResult
from flotilla.scheduling import RoundOutcome


@dataclass(slots=True)
class RoundTally:
    accepted: list[ParticipationRecord] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    durations: dict[str, float] = field(default_factory=dict)
    #: How the arbiter decided this round's devices (recorded with its metrics).
    schedule: dict[str, float] = field(default_factory=dict)
    #: Other numbers recorded with the round's metrics (server-less rounds' agreement).
    metrics: dict[str, float] = field(default_factory=dict)

    def done(self) -> set[str]:
        """Devices that delivered or failed: they owe this round nothing more."""
        return self.durations.keys() | set(self.failures)

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
            compute_s=compute,
            losses=losses,
            samples=samples,
        )


async def next_result(results: AsyncIterator[RoundResult], timeout_s: float) -> RoundResult | None:
    """The next result within ``timeout_s`` seconds; None when the stream ends or time is up."""
    if timeout_s <= 0:
        return None
    try:
        if sys.version_info >= (3, 11):
            # No task per result (wait_for makes one): thousands of results a round.
            async with asyncio.timeout(timeout_s):
                return await results.__anext__()
        return await asyncio.wait_for(results.__anext__(), timeout=timeout_s)
    except (StopAsyncIteration, asyncio.TimeoutError):
        return None
