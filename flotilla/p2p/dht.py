"""The DHT keys of a volunteer run, and reading and writing its records.

Stable, versioned keys (docs/p2p.md), next to the ones hivemind itself uses for the run
(``{run}_progress``, ``{run}_grad_averager``, ``{run}_state_averager``):

- ``{run}_flotilla_v1_record``: the signed :class:`~flotilla.p2p.record.RunRecord`,
  subkey = the coordinator's public key;
- ``{run}_flotilla_v1_metrics``: one :class:`PeerMetrics` per peer, subkey = the peer's
  hivemind RSA owner key (so the DHT itself refuses records a peer did not sign);
- ``{run}_flotilla_v1_status``: the coordinator's :class:`RunStatus` (same signing).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import hivemind
from hivemind.dht.schema import RSASignatureValidator
from hivemind.utils import get_dht_time

from flotilla.p2p.record import RunRecord, RunRecordError, SignedRecord, verify_record

#: Where a peer listens unless told otherwise: loopback only.
LOOPBACK_MADDRS = ("/ip4/127.0.0.1/tcp/0",)
RECORD_TTL_S = 120.0
METRICS_TTL_S = 60.0
DHT_TIMEOUT_S = 30.0


def record_key(run: str) -> str:
    return f"{run}_flotilla_v1_record"


def metrics_key(run: str) -> str:
    return f"{run}_flotilla_v1_metrics"


def status_key(run: str) -> str:
    return f"{run}_flotilla_v1_status"


def progress_key(run: str) -> str:
    """hivemind.Optimizer's own per-peer progress (epoch, samples, samples/s)."""
    return f"{run}_progress"


def start_dht(
    initial_peers: Sequence[str] = (),
    host_maddrs: Sequence[str] | None = None,
    client_mode: bool = False,
) -> hivemind.DHT:
    """A DHT node on loopback by default. Client mode (no incoming connections) is set
    here: hivemind 1.1.12 ignores ``Optimizer(client_mode=...)`` and takes the DHT's."""
    return hivemind.DHT(
        initial_peers=list(initial_peers),
        host_maddrs=[] if client_mode else list(host_maddrs or LOOPBACK_MADDRS),
        client_mode=client_mode,
        record_validators=[RSASignatureValidator()],
        startup_timeout=DHT_TIMEOUT_S,
        start=True,
    )


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs()]


def _owner_subkey() -> bytes:
    """This process's hivemind owner marker: records under it are signed and checked."""
    key: bytes = RSASignatureValidator().local_public_key
    return key


def publish_record(dht: hivemind.DHT, run: str, signed: SignedRecord) -> bool:
    return bool(
        dht.store(
            record_key(run),
            signed.to_wire(),
            get_dht_time() + RECORD_TTL_S,
            subkey=signed.public_key,
        )
    )


def fetch_record(
    dht: hivemind.DHT, run: str, trusted_key: str | None = None, wait_s: float = 10.0
) -> RunRecord:
    """The run's verified record. Waits up to ``wait_s`` for one to appear."""
    deadline = time.monotonic() + wait_s
    while True:
        found = dht.get(record_key(run), latest=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        if entries or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if not entries:
        raise RunRecordError(
            f"no run record for {run!r} in the DHT: is the run's coordinator up, and are "
            "--initial-peers right?"
        )
    valid: dict[str, RunRecord] = {}
    first_error: RunRecordError | None = None
    for subkey, item in entries.items():
        try:
            signed = SignedRecord.from_wire(item.value)
            if subkey != signed.public_key:
                raise RunRecordError("run record is stored under another key than its signer's")
            record = verify_record(signed, trusted_key)
            if record.run != run:
                raise RunRecordError(f"record names run {record.run!r}, not {run!r}")
            valid[signed.public_key] = record
        except RunRecordError as exc:
            first_error = first_error or exc
    if not valid:
        assert first_error is not None
        raise first_error
    if len(valid) > 1:
        raise RunRecordError(
            f"run {run!r} has records signed by {len(valid)} different keys; pass "
            "--coordinator-key to say which coordinator to trust"
        )
    return next(iter(valid.values()))


@dataclass(frozen=True, slots=True)
class PeerMetrics:
    """What a volunteer reports about itself, every few seconds."""

    peer: str
    epoch: int
    steps: int
    samples: int
    samples_per_second: float
    #: Mean training loss of the peer's steps in its current (else last) epoch.
    loss: float | None
    #: Mean loss per finished epoch, ``{epoch: loss}`` (the last few).
    epoch_losses: dict[str, float] = field(default_factory=dict)
    auxiliary: bool = False
    time: float = 0.0

    @classmethod
    def from_wire(cls, value: Any) -> PeerMetrics | None:
        if not isinstance(value, dict):
            return None
        try:
            return cls(**value)
        except TypeError:
            return None


def publish_metrics(dht: hivemind.DHT, run: str, metrics: PeerMetrics) -> bool:
    return bool(
        dht.store(
            metrics_key(run),
            dataclasses.asdict(metrics),
            get_dht_time() + METRICS_TTL_S,
            subkey=_owner_subkey(),
        )
    )


def read_metrics(dht: hivemind.DHT, run: str) -> list[PeerMetrics]:
    found = dht.get(metrics_key(run), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    out = [PeerMetrics.from_wire(item.value) for item in found.value.values()]
    return [m for m in out if m is not None]


@dataclass(frozen=True, slots=True)
class RunStatus:
    """A run as ``flotilla volunteer status`` shows it (the ``--json`` object)."""

    run: str
    epoch: int
    peers_online: int
    samples_per_second: float
    loss: float | None
    #: The global loss per epoch, oldest first (``[epoch, loss]`` pairs).
    loss_history: list[list[float]]
    checkpoint_epoch: int | None = None
    time: float = 0.0

    @classmethod
    def from_wire(cls, value: Any) -> RunStatus | None:
        if not isinstance(value, dict):
            return None
        try:
            return cls(**value)
        except TypeError:
            return None


def publish_status(dht: hivemind.DHT, status: RunStatus) -> bool:
    return bool(
        dht.store(
            status_key(status.run),
            dataclasses.asdict(status),
            get_dht_time() + METRICS_TTL_S,
            subkey=_owner_subkey(),
        )
    )


def read_status(dht: hivemind.DHT, run: str) -> RunStatus | None:
    found = dht.get(status_key(run), latest=True)
    if found is None or not isinstance(found.value, dict):
        return None
    statuses = [RunStatus.from_wire(item.value) for item in found.value.values()]
    fresh = [s for s in statuses if s is not None]
    return max(fresh, key=lambda s: s.time) if fresh else None
