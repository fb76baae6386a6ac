"""Plain, immutable rows the server passes around, so no ORM object escapes the store.

Times are unix seconds (``float``). Dicts inside the records are fresh copies built by the
store; treat them as read-only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Every state a job can be in, in lifecycle order.
JOB_STATES: tuple[str, ...] = ("pending", "running", "completed", "failed", "cancelled")

#: States a job never leaves: the store refuses any transition out of them.
TERMINAL_STATES: tuple[str, ...] = ("completed", "failed", "cancelled")

#: States the server picks up again after a restart.
RESUMABLE_STATES: tuple[str, ...] = ("pending", "running")


@dataclass(frozen=True, slots=True)
class DeviceRecord:
    """An enrolled device; ``profile`` holds e.g. gflops, memory_bytes, upload_bytes_per_s."""

    id: str
    credential_hash: str
    tasks: tuple[str, ...]
    profile: dict[str, float]
    enrolled_at: float
    last_seen_at: float


@dataclass(frozen=True, slots=True)
class JobRecord:
    """A training job; ``metrics`` are those of the latest committed round."""

    id: str
    name: str
    spec_json: str
    state: str
    rounds_total: int
    rounds_committed: int
    checkpoint_sha256: str
    created_at: float
    updated_at: float
    metrics: dict[str, float] = field(default_factory=dict)
    #: The aggregator's server state (optimizer moments, privacy history) after the last
    #: committed round; empty for stateless strategies.
    aggregator_sha256: str = ""
    #: The scheduler's history of this job's devices (JSON) as of the last committed round.
    scheduler_sha256: str = ""

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @classmethod
    def submitted(
        cls, job_id: str, name: str, spec_json: str, rounds: int, checkpoint: str, now: float
    ) -> JobRecord:
        """A new job: pending, nothing committed, its round-0 model at ``checkpoint``."""
        return cls(
            id=job_id,
            name=name,
            spec_json=spec_json,
            state="pending",
            rounds_total=rounds,
            rounds_committed=0,
            checkpoint_sha256=checkpoint,
            created_at=now,
            updated_at=now,
        )


@dataclass(frozen=True, slots=True)
class ParticipationRecord:
    """One device's contribution to one committed round."""

    job_id: str
    round: int
    device_id: str
    num_samples: int
    started_at: float
    finished_at: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """A committed round as read back from the store, with its participants."""

    job_id: str
    round: int
    checkpoint_sha256: str
    metrics: dict[str, float]
    started_at: float
    committed_at: float
    participants: tuple[ParticipationRecord, ...]


@dataclass(frozen=True, slots=True)
class RoundCommit:
    """Everything one round produced, written by the store in a single transaction."""

    job_id: str
    round: int
    checkpoint_sha256: str
    metrics: dict[str, float]
    started_at: float
    committed_at: float
    participants: tuple[ParticipationRecord, ...]
    #: Blob of the aggregator's state after this round; committed with the model.
    aggregator_sha256: str = ""
    #: Blob of the scheduler's history of this job's devices after this round.
    scheduler_sha256: str = ""
