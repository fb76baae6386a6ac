"""What every round mode shares: a round's tally and reading its result stream."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from flotilla.core.records import DeviceFailure, ParticipationRecord, RoundAccount
from flotilla.core.update import COMPUTE_METRIC, LOSS_METRIC
from flotilla.engine.backend import RoundResult
from flotilla.scheduling import Grant, RoundOutcome


@dataclass(slots=True)
class RoundTally:
    accepted: list[ParticipationRecord] = field(default_factory=list)
    #: Devices that delivered nothing usable (what the scheduler learns from).
    failures: list[str] = field(default_factory=list)
    #: Device -> why it failed (one of ``core.events.FAILURE_REASONS``).
    reasons: dict[str, str] = field(default_factory=dict)
    #: Devices whose update came (or will come) after the round had moved on: it was
    #: already full, or (buffered rounds) the update trained on an older model.
    stale: list[str] = field(default_factory=list)
    durations: dict[str, float] = field(default_factory=dict)
    #: How the arbiter decided this round's devices (recorded with its metrics).
    schedule: dict[str, float] = field(default_factory=dict)
    #: Other numbers recorded with the round's metrics (server-less rounds' agreement).
    metrics: dict[str, float] = field(default_factory=dict)
    #: Devices the round was dispatched to, and the decisions that shaped it.
    selected: tuple[str, ...] = ()
    decisions: list[str] = field(default_factory=list)

    def fail(self, device_id: str, reason: str) -> None:
        """``device_id`` delivered nothing usable, for ``reason``."""
        self.failures.append(device_id)
        self.reasons[device_id] = reason

    def merge(self, other: RoundTally) -> None:
        """Add one arrival's tally (buffered rounds) to the round's."""
        self.accepted += other.accepted
        self.durations.update(other.durations)
        self.failures += other.failures
        self.reasons.update(other.reasons)
        self.stale += other.stale
        self.selected += tuple(d for d in other.selected if d not in self.selected)

    def done(self) -> set[str]:
        """Devices that delivered or failed: they owe this round nothing more."""
        return self.durations.keys() | set(self.failures)

    def close(self, selected: Sequence[str], full: bool) -> None:
        """The round stopped listening. Selected devices that still owe it an update were
        ``cut_off`` when it closed ``full``, or missed its ``deadline`` (failures for the
        round's record and the event stream; the scheduler learns of them when they
        return or go silent)."""
        self.selected = tuple(selected)
        done = self.done() | {p.device_id for p in self.accepted} | set(self.stale)
        reason = "cut_off" if full else "deadline"
        for device_id in selected:
            if device_id not in done:
                self.reasons[device_id] = reason

    def account(self) -> RoundAccount:
        """The round's record beyond its participants (see ``RoundAccount``)."""
        return RoundAccount(
            selected=self.selected,
            failures=tuple(DeviceFailure(d, r) for d, r in sorted(self.reasons.items())),
            stale=tuple(sorted(set(self.stale))),
            bytes_up=round(self.metrics.get("bytes_up", _total(self.accepted, "bytes_up"))),
            bytes_down=round(_total(self.accepted, "bytes_down")),
            decisions=tuple(self.decisions),
        )

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


def _total(accepted: Sequence[ParticipationRecord], key: str) -> float:
    return sum(p.metrics.get(key, 0.0) for p in accepted)


def grant_decisions(grant: Grant, selector: str) -> list[str]:
    """The arbiter's decision for one round, as lines a person reads on the dashboard."""
    lines = [f"selected {len(grant.devices)} of {grant.candidates} idle by {selector}"]
    if grant.waited_s >= 0.05:
        lines.append(f"waited {grant.waited_s:.1f} s for devices")
    if grant.contenders > 1:
        others = grant.contenders - 1
        lines.append(f"decided jointly with {others} other waiting job{'s' * (others > 1)}")
    return lines


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
