"""What each device has done for each job: the evidence every selector learns from.

Kept per (job, device) because the same phone is transfer-bound for a wide model and
compute-bound for many local epochs. Round times are kept in log space (a running mean and
variance), which is how device speeds are distributed and what the duration model needs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    """What a round taught the scheduler, reported by the engine after it closes."""

    job_id: str
    round: int
    #: Seconds from dispatch to accepted update, per device that delivered.
    durations: Mapping[str, float]
    #: Devices that were selected but delivered nothing usable.
    failures: Sequence[str]
    #: Every device the round was dispatched to (delivered, failed or still out).
    selected: Sequence[str] = ()
    #: Of ``durations``, the seconds spent training (``compute_s`` reported by the device);
    #: the rest was transfer and latency.
    compute_s: Mapping[str, float] = field(default_factory=dict)
    #: The training loss each delivering device reported (``train_loss``).
    losses: Mapping[str, float] = field(default_factory=dict)
    #: Samples each delivering device trained on.
    samples: Mapping[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class DeviceHistory:
    """One device's record for one job."""

    selected: int = 0
    delivered: int = 0
    failures: int = 0
    #: Round of the job in which the device was last selected (0: never).
    last_round: int = 0
    #: Running mean and variance (Welford) of log(round seconds) over delivered rounds.
    log_mean: float = 0.0
    log_m2: float = 0.0
    #: Running means of compute and transfer seconds, to tell the bottleneck apart.
    compute_s: float = 0.0
    transfer_s: float = 0.0
    last_loss: float | None = None
    last_samples: int = 0

    @property
    def log_var(self) -> float:
        """Variance of log round time; 0 with fewer than two observations."""
        return self.log_m2 / (self.delivered - 1) if self.delivered > 1 else 0.0

    def add_duration(self, seconds: float, compute_s: float | None) -> None:
        self.delivered += 1
        x = math.log(max(seconds, 1e-6))
        delta = x - self.log_mean
        self.log_mean += delta / self.delivered
        self.log_m2 += delta * (x - self.log_mean)
        if compute_s is not None and 0.0 <= compute_s <= seconds:
            n = self.delivered
            self.compute_s += (compute_s - self.compute_s) / n
            self.transfer_s += (seconds - compute_s - self.transfer_s) / n


#: DeviceHistory's fields, all scalars.
_HISTORY_FIELDS = tuple(f.name for f in fields(DeviceHistory))


@dataclass(frozen=True, slots=True)
class KnobTrial:
    """One round of a job run with some knobs, and how much faster than usual it learned:
    the evidence a tuner pools across jobs (:mod:`flotilla.scheduling.tuned`)."""

    round: int
    #: The knob values the round's devices were chosen with.
    knobs: tuple[float, ...]
    #: What the job looked like then (:func:`flotilla.scheduling.tuned.job_context`).
    context: tuple[float, ...]
    #: Progress per second relative to the job's recent progress (0: as usual).
    reward: float


@dataclass(slots=True)
class FleetHistory:
    """``(job, device) -> DeviceHistory``, plus each job's rounds so far and the knob
    trials tuners made on it."""

    records: dict[str, dict[str, DeviceHistory]] = field(default_factory=dict)
    rounds: dict[str, int] = field(default_factory=dict)
    trials: dict[str, list[KnobTrial]] = field(default_factory=dict)

    def add_trial(self, job_id: str, trial: KnobTrial) -> None:
        self.trials.setdefault(job_id, []).append(trial)

    def all_trials(self) -> list[KnobTrial]:
        """Every job's trials: what one job learned serves the next."""
        return [t for trials in self.trials.values() for t in trials]

    def record(self, outcome: RoundOutcome) -> None:
        job = self.records.setdefault(outcome.job_id, {})
        self.rounds[outcome.job_id] = max(self.rounds.get(outcome.job_id, 0), outcome.round)
        for device_id in set(outcome.selected) | set(outcome.durations) | set(outcome.failures):
            rec = job.setdefault(device_id, DeviceHistory())
            rec.selected += 1
            rec.last_round = outcome.round
        for device_id, seconds in outcome.durations.items():
            job[device_id].add_duration(seconds, outcome.compute_s.get(device_id))
        for device_id in outcome.failures:
            job[device_id].failures += 1
        for device_id, loss in outcome.losses.items():
            if math.isfinite(loss):
                job[device_id].last_loss = float(loss)
        for device_id, n in outcome.samples.items():
            job[device_id].last_samples = int(n)

    def failure_rate(self, job_id: str, prior_failures: float = 1.0, prior: float = 20.0) -> float:
        """Share of the job's selections that delivered nothing, shrunk toward
        ``prior_failures / prior`` (5 %) while there are few."""
        records = self.records.get(job_id, {}).values()
        failures = sum(r.failures for r in records)
        selected = sum(r.selected for r in records)
        return (failures + prior_failures) / (selected + prior)

    def get(self, job_id: str, device_id: str) -> DeviceHistory | None:
        return self.records.get(job_id, {}).get(device_id)

    def job(self, job_id: str) -> Mapping[str, DeviceHistory]:
        return self.records.get(job_id, {})

    def selection_counts(self, job_id: str, device_ids: Iterable[str]) -> np.ndarray:
        """Times each device was selected for ``job_id``, in the order given."""
        job = self.records.get(job_id, {})
        return np.array([job[d].selected if d in job else 0 for d in device_ids], dtype=np.float64)

    def job_state(self, job_id: str) -> dict[str, Any]:
        """One job's records as plain data: committed with each of its rounds, so a
        restarted server picks up where the job's scheduling was."""
        # Scalar fields only: a shallow copy, not asdict's deep one (1,000 devices a round).
        job = self.records.get(job_id, {})
        records = {d: {f: getattr(r, f) for f in _HISTORY_FIELDS} for d, r in job.items()}
        trials = [asdict(t) for t in self.trials.get(job_id, [])]
        return {"round": self.rounds.get(job_id, 0), "records": records, "trials": trials}

    def restore_job(self, job_id: str, data: Mapping[str, Any]) -> None:
        """Put back what :meth:`job_state` returned."""
        self.records[job_id] = {d: DeviceHistory(**r) for d, r in data["records"].items()}
        self.rounds[job_id] = int(data["round"])
        self.restore_trials(job_id, data)

    def restore_trials(self, job_id: str, data: Mapping[str, Any]) -> None:
        """Put back only the knob trials of what :meth:`job_state` returned (a finished
        job's lesson, for the jobs that come after it)."""
        self.trials[job_id] = [
            KnobTrial(int(t["round"]), tuple(t["knobs"]), tuple(t["context"]), float(t["reward"]))
            for t in data.get("trials", [])
        ]
