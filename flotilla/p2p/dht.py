"""The DHT keys of a volunteer run, and reading and writing its records.

Stable, versioned keys (docs/p2p.md), next to the ones hivemind itself uses for the run's
swarm (``{swarm}_progress``, ``{swarm}_grad_averager``, ``{swarm}_state_averager``, where
``swarm`` is :attr:`~flotilla.p2p.record.RunRecord.swarm`: the run's name, or in a verified
run the name + ``_flotilla_v1_verified``):

- ``{run}_flotilla_v1_record``: the signed :class:`~flotilla.p2p.record.RunRecord`,
  subkey = the coordinator's public key;
- ``{run}_flotilla_v1_metrics``: one :class:`PeerMetrics` per peer, subkey = the peer's
  hivemind RSA owner key (so the DHT itself refuses records a peer did not sign);
- ``{run}_flotilla_v1_status``: the coordinator's :class:`RunStatus` (same signing).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, TypeVar

import hivemind
import torch.multiprocessing
from hivemind.dht.schema import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from flotilla.core.errors import RunRecordError
from flotilla.core.lifetime import die_with_parent
from flotilla.core.timeouts import Timeouts
from flotilla.p2p.record import RunRecord, SignedRecord, verify_record

#: Where a peer listens unless told otherwise: loopback only.
LOOPBACK_MADDRS = ("/ip4/127.0.0.1/tcp/0",)
RECORD_TTL_S = 120.0
METRICS_TTL_S = 60.0
#: A peer whose last metrics are older than this is no longer counted online.
ONLINE_S = 10.0
#: The longest sketch a peer's metrics may carry (flotilla sends 32 numbers).
MAX_SKETCH = 256
#: The most neighbours a peer's metrics may name (a gossip step has one or a few).
MAX_NEIGHBOURS = 64
T = TypeVar("T")

log = logging.getLogger(__name__)


def record_key(run: str) -> str:
    return f"{run}_flotilla_v1_record"


def metrics_key(run: str) -> str:
    return f"{run}_flotilla_v1_metrics"


def status_key(run: str) -> str:
    return f"{run}_flotilla_v1_status"


def progress_key(swarm: str) -> str:
    """hivemind.Optimizer's own per-peer progress (epoch, samples, samples/s)."""
    return f"{swarm}_progress"


def training_peers(dht: hivemind.DHT, swarm: str) -> set[str]:
    """The peers (base58 ids) whose hivemind optimizer reports progress in ``swarm``."""
    found = dht.get(progress_key(swarm), latest=True)
    peers: set[str] = set()
    if found is None or not isinstance(found.value, dict):
        return peers
    for entry in found.value.values():
        value = getattr(entry, "value", None)
        peer = value.get("peer_id") if isinstance(value, dict) else None
        if isinstance(peer, bytes):
            peers.add(PeerID(peer).to_base58())
    return peers


class WorkerDHT(hivemind.DHT):  # type: ignore[misc]
    """A hivemind DHT whose worker process ends with its parent (flotilla.core.lifetime) and
    survives requests it cannot read (:class:`RequestPipe`)."""

    _inner_pipe: Any

    def run(self) -> None:
        die_with_parent()
        self._inner_pipe = RequestPipe(self._inner_pipe)
        super().run()

    async def _skip(self) -> None:
        """What :class:`RequestPipe` hands hivemind's loop in place of an unreadable request."""


class RequestPipe:
    """The DHT worker's end of its request pipe, for hivemind's serving loop.

    Averager processes (forked from the DHT's owner) send the worker requests carrying a
    pipe of theirs, which the worker rebuilds through the sender's multiprocessing
    resource sharer. When the averager has exited before the worker reads the request (a
    round's averager shut down), rebuilding it fails with FileNotFoundError or EOFError;
    hivemind 1.1.12 skips the first but dies of the second, leaving every later averager
    of the process waiting on a dead DHT. A request that cannot be read becomes a
    warning and a no-op here (hivemind would also pause its loop for seconds on an error);
    a closed pipe still ends the worker.

    The pipe's descriptor may be non-blocking, and a large request is written as its
    length, then its body: read without blocking, a body not there yet fails with EAGAIN
    after the length was taken, and the stream is out of step for good (seen on a loaded
    machine). A request is therefore read whole, blocking (hivemind reads only once the
    pipe polls readable, and the body follows at once).
    """

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._warned = False

    def recv(self) -> Any:
        fd = self._conn.fileno()
        blocking = os.get_blocking(fd)
        if not blocking:
            os.set_blocking(fd, True)
        try:
            data = self._conn.recv_bytes()  # EOFError here: the pipe itself is closed
        finally:
            if not blocking:
                os.set_blocking(fd, False)
        try:
            return ForkingPickler.loads(data)
        except Exception as exc:
            # Said once: a process stopping (Ctrl-C) ends its averagers with requests
            # still queued, a dozen at a time.
            level = logging.DEBUG if self._warned else logging.WARNING
            self._warned = True
            log.log(level, "DHT worker skipped a request whose sender had exited: %r", exc)
            return "_skip", [], {}

    def __getattr__(self, name: str) -> Any:  # fileno, poll: the connection's own
        return getattr(self._conn, name)


def start_dht(
    initial_peers: Sequence[str] = (),
    host_maddrs: Sequence[str] | None = None,
    client_mode: bool = False,
    identity_path: Path | None = None,
    announce_maddrs: Sequence[str] | None = None,
    startup_s: float | None = None,
) -> hivemind.DHT:
    """A DHT node on loopback by default. Client mode (no incoming connections) is set
    here: hivemind 1.1.12 ignores ``Optimizer(client_mode=...)`` and takes the DHT's.
    ``identity_path`` keeps the peer id across restarts (hivemind creates the key file);
    ``startup_s`` defaults to ``Timeouts.dht_start_s``."""
    # hivemind hands tensors between its processes as files in /dev/shm (its default), and
    # a peer killed with kill -9 leaves hundreds behind; as descriptors, the kernel frees
    # them with the process. Set before the DHT forks, for every worker this peer starts.
    torch.multiprocessing.set_sharing_strategy("file_descriptor")  # type: ignore[no-untyped-call]
    extra: dict[str, Any] = {}
    if identity_path is not None:
        identity_path.parent.mkdir(parents=True, exist_ok=True)
        extra["identity_path"] = str(identity_path)
    if announce_maddrs:  # what others dial when this peer sits behind a NAT or proxy
        extra["announce_maddrs"] = list(announce_maddrs)
    return WorkerDHT(
        initial_peers=list(initial_peers),
        host_maddrs=[] if client_mode else list(host_maddrs or LOOPBACK_MADDRS),
        client_mode=client_mode,
        record_validators=[RSASignatureValidator()],
        startup_timeout=Timeouts().dht_start_s if startup_s is None else startup_s,
        start=True,
        **extra,
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
    dht: hivemind.DHT, run: str, trusted_key: str | None = None, wait_s: float | None = None
) -> RunRecord:
    """The run's verified record. Waits up to ``wait_s`` (default
    ``Timeouts.record_wait_s``) for one to appear."""
    deadline = time.monotonic() + (Timeouts().record_wait_s if wait_s is None else wait_s)
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
    #: Gossip runs: the peer's parameters projected on the run's seeded directions
    #: (flotilla.p2p.gossip.consensus), so readers can tell how far apart the peers are.
    sketch: list[float] | None = None
    #: Gossip runs: the peers this one mixed with at its last gossip step.
    neighbours: list[str] | None = None

    def __post_init__(self) -> None:
        # Records come from any peer: a wrong type is refused here, not met in arithmetic.
        _check_types(self, PEER_METRIC_TYPES)
        if self.neighbours is not None and not _peer_list(self.neighbours):
            raise TypeError(f"neighbours are at most {MAX_NEIGHBOURS} peer ids")
        if not all(
            isinstance(k, str) and k.isdigit() and _is_number(v)
            for k, v in self.epoch_losses.items()
        ):
            raise TypeError("epoch_losses must map epoch numbers to losses")
        if self.sketch is not None and not (
            len(self.sketch) <= MAX_SKETCH and all(_is_number(v) for v in self.sketch)
        ):
            raise TypeError(f"a sketch is at most {MAX_SKETCH} numbers")


def publish_metrics(
    dht: hivemind.DHT, run: str, metrics: PeerMetrics, *, wait: bool = True
) -> bool:
    """Store ``metrics``; ``wait=False`` hands the write to the DHT and returns at once (a
    training loop over a slow link must not wait seconds for it; a failure is logged)."""
    return _store_own(dht, metrics_key(run), metrics, wait=wait)


def read_metrics(dht: hivemind.DHT, run: str) -> list[PeerMetrics]:
    return _read_all(dht, metrics_key(run), PeerMetrics)


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
    #: The record's averaging (``gradients``, ``state``, ``gossip``).
    averaging: str | None = None
    #: Gossip runs: the largest distance of a peer's parameters from the peers' mean,
    #: estimated from their sketches (None for other runs, or fewer than two sketches).
    consensus_distance: float | None = None
    #: Gossip runs: the peer serving the last checkpoint (the coordinator), from which a
    #: volunteer joining a run with no member left resumes.
    checkpoint_peer: str | None = None
    #: Gossip runs: each online peer's neighbours at its last gossip step.
    neighbours: dict[str, list[str]] | None = None

    def __post_init__(self) -> None:
        _check_types(self, RUN_STATUS_TYPES)
        if self.neighbours is not None and not all(
            isinstance(k, str) and _peer_list(v) for k, v in self.neighbours.items()
        ):
            raise TypeError("neighbours must map peer ids to lists of peer ids")
        if not all(
            isinstance(p, list) and len(p) == 2 and all(_is_number(x) for x in p)
            for p in self.loss_history
        ):
            raise TypeError("loss_history must be [epoch, loss] pairs")


def publish_status(dht: hivemind.DHT, status: RunStatus) -> bool:
    return _store_own(dht, status_key(status.run), status)


def read_status(dht: hivemind.DHT, run: str) -> RunStatus | None:
    statuses = _read_all(dht, status_key(run), RunStatus)
    return max(statuses, key=lambda s: s.time) if statuses else None


def _store_own(dht: hivemind.DHT, key: str, record: Any, wait: bool = True) -> bool:
    """Store a dataclass under this peer's owner subkey: hivemind signs it, and peers'
    validators refuse it if anyone else rewrites it."""
    stored = dht.store(
        key,
        dataclasses.asdict(record),
        get_dht_time() + METRICS_TTL_S,
        subkey=_owner_subkey(),
        return_future=not wait,
    )
    if wait:
        return bool(stored)
    stored.add_done_callback(partial(_say_if_not_stored, key))
    return True


def _say_if_not_stored(key: str, stored: Any) -> None:
    try:
        if not stored.result():
            log.warning("no DHT node stored %s", key)
    except Exception as exc:  # the DHT shut down, a timeout: the next write may do
        log.warning("could not store %s: %s", key, exc)


def _read_all(dht: hivemind.DHT, key: str, cls: type[T]) -> list[T]:
    """Every well-formed record under ``key``; malformed ones (another version) are skipped."""
    found = dht.get(key, latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    out = []
    for item in found.value.values():
        if isinstance(item.value, dict):
            try:
                out.append(cls(**item.value))
            except TypeError:
                continue
    return out


PEER_METRIC_TYPES: dict[str, tuple[type, ...]] = {
    "peer": (str,),
    "epoch": (int,),
    "steps": (int,),
    "samples": (int,),
    "samples_per_second": (int, float),
    "loss": (int, float, type(None)),
    "epoch_losses": (dict,),
    "auxiliary": (bool,),
    "time": (int, float),
    "sketch": (list, type(None)),
    "neighbours": (list, type(None)),
}
RUN_STATUS_TYPES: dict[str, tuple[type, ...]] = {
    "run": (str,),
    "epoch": (int,),
    "peers_online": (int,),
    "samples_per_second": (int, float),
    "loss": (int, float, type(None)),
    "loss_history": (list,),
    "checkpoint_epoch": (int, type(None)),
    "time": (int, float),
    "averaging": (str, type(None)),
    "consensus_distance": (int, float, type(None)),
    "checkpoint_peer": (str, type(None)),
    "neighbours": (dict, type(None)),
}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _peer_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) <= MAX_NEIGHBOURS
        and all(isinstance(p, str) for p in value)
    )


def _check_types(record: Any, types: dict[str, tuple[type, ...]]) -> None:
    for name, allowed in types.items():
        value = getattr(record, name)
        if not isinstance(value, allowed) or (bool not in allowed and isinstance(value, bool)):
            raise TypeError(f"{name} has type {type(value).__name__}")
