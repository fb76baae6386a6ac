"""Plain, immutable rows the server passes around, so no ORM object escapes the store.

Times are unix seconds (``float``). Dicts inside the records are fresh copies built by the
store; treat them as read-only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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
    #: What kind of device it says it is (``DeviceProfile.device_class``); "" unset.
    device_class: str = ""
    #: Hex Ed25519 key its updates are signed with; "" for a device enrolled before keys.
    public_key: str = ""
    #: When the operator revoked it (``time.time()``); None while it is trusted.
    revoked_at: float | None = None
    #: Training samples it holds per task (``DeviceProfile.samples``); empty: none counted.
    samples: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RefusalRecord:
    """An update the server refused, kept for the operator: who, for what round, and why
    (``reason``: one of ``core.events.REFUSAL_REASONS``; ``detail``: the error's words)."""

    at: float
    device_id: str
    job_id: str
    round: int
    reason: str
    detail: str = ""


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
class DeviceFailure:
    """A device selected for a round that delivered nothing usable, and why (one of
    :data:`flotilla.core.events.FAILURE_REASONS`)."""

    device_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class RoundAccount:
    """How a committed round went beyond who delivered: what the dashboard's round
    timeline shows. Rounds committed before it was recorded read back empty."""

    #: Devices the scheduler dispatched the round to.
    selected: tuple[str, ...] = ()
    failures: tuple[DeviceFailure, ...] = ()
    #: Devices whose update arrived after the round had moved on (a full synchronous
    #: round; a FedBuff update trained on an older model).
    stale: tuple[str, ...] = ()
    #: Update bytes the server took in, and model bytes its contributors downloaded.
    bytes_up: int = 0
    bytes_down: int = 0
    #: What the scheduler and engine decided, one short line each.
    decisions: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the store's column, the simulation's ``metrics.jsonl``)."""
        return {
            "selected": list(self.selected),
            "failures": [{"device_id": f.device_id, "reason": f.reason} for f in self.failures],
            "stale": list(self.stale),
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "decisions": list(self.decisions),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> RoundAccount:
        """Read back what :meth:`to_json` wrote; missing keys (older rows) read as empty."""
        if not data:
            return cls()
        return cls(
            selected=tuple(str(d) for d in data.get("selected", ())),
            failures=tuple(
                DeviceFailure(str(f["device_id"]), str(f["reason"]))
                for f in data.get("failures", ())
            ),
            stale=tuple(str(d) for d in data.get("stale", ())),
            bytes_up=int(data.get("bytes_up", 0)),
            bytes_down=int(data.get("bytes_down", 0)),
            decisions=tuple(str(d) for d in data.get("decisions", ())),
        )


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
    account: RoundAccount = field(default_factory=RoundAccount)


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
    account: RoundAccount = field(default_factory=RoundAccount)
    #: Bytes of the checkpoint blob (0: unknown), so its row can be checked against it.
    checkpoint_size: int = 0


@dataclass(frozen=True, slots=True)
class EnrolTokenRecord:
    """An enrolment token as the operator sees it: never the token, only its hash's id."""

    #: The first 12 hex digits of the token's SHA-256: what ``token revoke`` takes.
    id: str
    created_at: float
    #: Enrolments it still admits; None: unlimited.
    uses_left: int | None
    #: None: never expires.
    expires_at: float | None
    revoked_at: float | None
    #: ``active``, ``expired``, ``used up`` or ``revoked``, as of the listing.
    state: str


@dataclass(frozen=True, slots=True)
class JobLease:
    """Which server process of a deployment runs a job (``holder``), since which change of
    holder (``epoch``), until when unless renewed (``expires_at``, unix seconds)."""

    job_id: str
    holder: str
    epoch: int
    expires_at: float


@dataclass(frozen=True, slots=True)
class LeaseFence:
    """What a round commit proves: the job's lease it was made under, and how long to
    extend it. The store commits only if ``holder`` still holds that job's lease at
    ``epoch``, unexpired, and extends it by ``lease_s`` in the same transaction."""

    holder: str
    epoch: int
    lease_s: float


@dataclass(frozen=True, slots=True)
class ServerPresence:
    """A server process of a deployment, as it last announced itself: alive until
    ``expires_at`` unless it announces again, and how many devices its waiting jobs lack,
    per task (``wanted``: the other servers send it idle devices of those tasks)."""

    holder: str
    expires_at: float
    wanted: tuple[tuple[str, int], ...] = ()
