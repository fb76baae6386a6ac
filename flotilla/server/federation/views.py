"""The values the federation core takes from and hands to its edges (gRPC today, HTTP next).

Frozen and transport-free: an edge converts its own messages to and from these in one
module (``flotilla.server.grpc.wire`` for gRPC), and the core never sees a wire type. What a
device and the server say about a round (``RoundRef``, ``UploadHeader``, ``Reservation``,
``ReportVerdict``, ``DeviceCredential``) is in :mod:`flotilla.core.work`, shared with the agent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from flotilla.core.conditions import DeviceConditions
from flotilla.core.records import JobRecord, RoundRecord


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """One enrolled device as an operator sees it: the pool's view, or offline."""

    id: str
    #: ``offline``, ``idle``, ``busy`` or ``ineligible``.
    state: str
    job_id: str
    reason: str
    tasks: tuple[str, ...]
    gflops: float
    upload_bytes_per_s: float
    #: Unix seconds; 0.0 for a device not seen since the server started.
    last_seen: float
    #: Job id -> rounds this device was selected for.
    selected: Mapping[str, int] = field(default_factory=dict)
    #: Job id -> rounds this device delivered an update to.
    delivered: Mapping[str, int] = field(default_factory=dict)
    #: What kind of device it says it is ("" unset).
    device_class: str = ""
    #: What it last said of battery, power, network, idleness; None: not seen since start.
    conditions: DeviceConditions | None = None
    #: Running job id -> why that job may not select it now (jobs that may are absent).
    ineligible: Mapping[str, str] = field(default_factory=dict)
    #: Task -> training samples it holds, as it last reported (tasks it did not count absent).
    samples: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class VolunteerRunInfo:
    """A volunteer run this server coordinates, and where its peers join it."""

    run: str
    task: str
    maddrs: tuple[str, ...]
    coordinator_key: str
    #: The coordinator's latest ``status.json``; empty before it wrote one.
    status_json: str


@dataclass(frozen=True, slots=True)
class BlobSlice:
    """One chunk of a blob on its way to a device or operator; the first names the whole."""

    data: bytes
    offset: int
    #: Set on the first chunk only (0 on the rest), as the wire format has it.
    total_size: int = 0
    sha256: str = ""


@dataclass(frozen=True, slots=True)
class JobDetail:
    """A job and, when asked for, its committed rounds."""

    job: JobRecord
    rounds: tuple[RoundRecord, ...] | None = None
