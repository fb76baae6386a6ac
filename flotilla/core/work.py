"""What a device and the server say to each other about a round, as plain values.

The work order a device gets, the round it quotes back, the header of its upload and the
server's answers: the same types on both sides of every edge (gRPC today, HTTP later,
in-process in tests). The engine's own ``TrainTask`` adds what only the server needs
(layout, codec, transport) and is cut down to a :class:`WorkOrder` at the edge.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class DeviceCredential:
    """What a device proves itself with after enrolment: the server hands it out once and
    keeps only the secret's hash."""

    device_id: str
    secret: str = field(repr=False)


@dataclass(frozen=True, slots=True)
class RoundRef:
    """One attempt at one round of one job: what every message about a round quotes."""

    job_id: str
    round: int
    #: Unique per attempt at a round, so a message from an earlier attempt is stale.
    round_token: str


@dataclass(frozen=True, slots=True)
class WorkOrder:
    """One round's work for a device: the model to fetch, the config to train with."""

    job_id: str
    round: int
    round_token: str
    #: The task's entry point name.
    task: str
    #: The job spec's train, data and compression sections (and layout, group plan), JSON.
    config_json: str
    model_sha256: str
    model_size: int
    #: When the round closes, as ``time.time()``.
    deadline: float
    seed: int
    #: Downlink delta: a device holding the model ``delta_base_sha256`` may instead fetch
    #: this codec-compressed change and add it, which must give ``model_sha256`` exactly.
    delta_base_sha256: str = ""
    delta_sha256: str = ""
    delta_size: int = 0
    #: The uplink codec this device must use; ``""``: the job's ``compression.uplink``.
    uplink_codec: str = ""

    @property
    def ref(self) -> RoundRef:
        return RoundRef(self.job_id, self.round, self.round_token)


@dataclass(frozen=True, slots=True)
class UploadHeader:
    """What precedes an update's bytes: its round, size, checksum and codec."""

    ref: RoundRef
    num_samples: int
    payload_size: int
    payload_sha256: str
    #: The uplink codec's name; ``""`` or ``"safetensors"`` mean plain safetensors.
    codec: str
    metrics: Mapping[str, float] = field(default_factory=dict)
    #: A key from a reservation, or ``""`` to wait for room with the upload under way.
    reservation: str = ""
    #: ``core.identity``: 16 fresh random bytes, and the device's Ed25519 signature of the
    #: statement over job, round, round token, payload SHA-256 and this nonce.
    nonce: bytes = field(default=b"", repr=False)
    signature: bytes = field(default=b"", repr=False)


@dataclass(frozen=True, slots=True)
class Reservation:
    """Room on the server held for one device's next upload; start it within ``ttl_s``."""

    key: str
    ttl_s: float


@dataclass(frozen=True, slots=True)
class ReportVerdict:
    """The answer to a server-less round's report: upload the average now? still open?"""

    upload: bool
    round_open: bool
