"""The read model: what the dashboard and the ``/api/v1`` read routes show, whatever feeds it.

Two sources implement it: the live federation (``flotilla.server.http``) and a
simulation's output directory (``flotilla.dashboard.simulation``, for ``flotilla dashboard
DIR``). The routes render these values as JSON in one place; neither source knows HTTP.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class JobView:
    """One job as a listing shows it (the fields of ``job status --json``)."""

    id: str
    name: str
    state: str
    task: str
    rounds_committed: int
    rounds_total: int
    #: The latest committed round's metrics.
    metrics: Mapping[str, float]
    created_at: float
    updated_at: float


@dataclass(frozen=True, slots=True)
class ParticipantView:
    device_id: str
    num_samples: int
    metrics: Mapping[str, float]
    #: The device's class (``phone``, ``gpu``, ...) where known; empty otherwise.
    device_class: str = ""


@dataclass(frozen=True, slots=True)
class FailureView:
    """A device selected for a round that did not deliver, and why (``timeout``,
    ``dropped``, ``left``, ``refused:<reason>``, ...)."""

    device_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class RoundView:
    """One committed round (the shape of ``job status --json --rounds``, and more)."""

    round: int
    metrics: Mapping[str, float]
    participants: tuple[str, ...]
    devices: tuple[ParticipantView, ...]
    started_at: float
    committed_at: float
    checkpoint_sha256: str
    #: Devices the scheduler picked for this round (participants are those that delivered).
    selected: tuple[str, ...] = ()
    failures: tuple[FailureView, ...] = ()
    #: Devices whose update arrived after the round had moved on.
    stale: tuple[str, ...] = ()
    bytes_up: int = 0
    bytes_down: int = 0
    #: What the scheduler/arbiter decided and why, in its own words (one line each).
    decisions: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class DeviceStatus:
    """One enrolled device (the fields of ``devices list --json``, plus what the
    dashboard filters and counts by)."""

    id: str
    #: ``offline``, ``idle``, ``busy`` or ``ineligible``.
    state: str
    #: The job it serves now; empty when none.
    job: str
    device_class: str
    tasks: tuple[str, ...]
    gflops: float
    upload_bytes_per_s: float
    #: Unix seconds; 0.0 when not seen since the server started.
    last_seen: float
    rounds_served: int
    #: Failures by reason (``timeout``: 2, ...).
    failures: Mapping[str, int] = field(default_factory=dict)
    #: Why the device may not be selected now; empty when it may.
    ineligible_reason: str = ""
    #: Task -> training samples it holds, as it last reported (tasks it did not count absent).
    samples: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class VolunteerRunView:
    run: str
    task: str
    peers_online: int
    samples_per_s: float
    #: (unix seconds, loss) points, oldest first.
    loss_history: tuple[tuple[float, float], ...] = ()
    maddrs: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Change:
    """Something a live view should refetch: ``kind`` is ``job`` (``job_id`` set: its
    state or rounds changed), ``devices`` or ``volunteers``."""

    kind: str
    job_id: str = ""


class JobsSource(Protocol):
    async def jobs(self) -> Sequence[JobView]: ...

    async def rounds(self, job_id: str) -> Sequence[RoundView]:
        """Committed rounds, oldest first; raises ``NotFoundError`` for an unknown job."""
        ...


class FleetSource(Protocol):
    async def devices(self) -> Sequence[DeviceStatus]: ...

    async def volunteer_runs(self) -> Sequence[VolunteerRunView]: ...


class ChangeSource(Protocol):
    def changes(self) -> AsyncIterator[Change]:
        """Changes from now on, until the caller stops iterating (one subscriber each)."""
        ...


@dataclass(frozen=True, slots=True)
class ReadModel:
    """Everything the read routes and the dashboard need from one source."""

    jobs: JobsSource
    fleet: FleetSource
    changes: ChangeSource
