"""A volunteer run's description, signed by its coordinator.

Anyone can write to a DHT, so a volunteer trusts a run record only when its Ed25519
signature verifies, and, when told the coordinator's key (``--coordinator-key``), only
when that key signed it. A record signed by someone else, or altered after signing, is
refused with :class:`RunRecordError` before any training starts.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from flotilla.core.errors import RunRecordError, SpecError
from flotilla.p2p.codecs import COMPRESSION_NAMES

#: Bumped when a field changes meaning; a volunteer refuses records of another schema.
#: 2: ``averaging = "gossip"`` and the ``gossip_*`` fields.
SCHEMA_VERSION = 3
#: Schemas this flotilla reads: an older record lacks only fields added since, which take
#: their defaults (schema 2 had no ``delayed_averaging``).
READABLE_SCHEMAS = (2, 3)
#: How gossip peers pick their neighbours (flotilla.p2p.gossip.graph) and mix.
GOSSIP_TOPOLOGIES = ("exponential", "ring", "random")
GOSSIP_MODES = ("sync", "async")
#: Appended to a verified run's name for hivemind's keys (:func:`swarm_name`).
VERIFIED_SWARM = "_flotilla_v1_verified"


def swarm_name(run: str, verified: bool) -> str:
    """A run's name in hivemind's own keys (its optimizer's ``run_id``): the run's name
    when plain hivemind peers may average, else ``RUN`` + :data:`VERIFIED_SWARM`, so a
    plain peer (whose ``run_id`` is the run's name) never finds a verified group to join,
    nor a verified peer to download state from, and cannot stall the run."""
    return run + VERIFIED_SWARM if verified else run


@dataclass(frozen=True, slots=True)
class RunRecord:
    """What every peer of a run must agree on. Times are seconds."""

    run: str
    #: Task entry point (``package.module:Name``); volunteers must have it installed.
    task: str
    #: SHA-256 of the initial model (``task.build_model(seed)``), so peers know they agree.
    model_sha256: str
    seed: int = 0
    #: Samples the whole swarm accumulates per optimizer epoch (hivemind's target batch).
    target_batch_size: int = 1024
    #: Suggested samples per local step (a volunteer may override it).
    batch_size: int = 16
    #: ``adam`` or ``sgd``, and its learning rate.
    optimizer: str = "adam"
    learning_rate: float = 3e-3
    #: What averaging rounds send: ``none``, ``fp16`` or ``int8``.
    compression: str = "none"
    #: ``gradients`` (hivemind's gradient averaging, one global step per epoch),
    #: ``state`` (local steps, parameters averaged every epoch) or ``gossip`` (local steps,
    #: parameters mixed with a neighbour per epoch by push-sum: no group, no barrier).
    averaging: str = "gradients"
    #: Whole-or-nothing rounds (flotilla.p2p.averaging). Plain-hivemind peers cannot take
    #: part in the verdict round, so a run meant for them sets this false; in a verified
    #: run they are never grouped with flotilla peers (:attr:`swarm`).
    verified_averaging: bool = True
    matchmaking_time: float = 5.0
    averaging_timeout: float = 30.0
    allreduce_timeout: float = 20.0
    next_chunk_timeout: float = 10.0
    load_state_timeout: float = 60.0
    #: Shards the corpus is cut into; a volunteer trains on the one its peer id picks.
    shards: int = 64
    #: Gossip runs: the graph (``exponential``, ``ring``, ``random``), the mixing
    #: (``sync``: both sides of an edge mix the same epoch; ``async``: on arrival, with the
    #: epoch's shares travelling while the next computes), and a gossip step's longest wait.
    gossip_topology: str = "exponential"
    gossip_mode: str = "sync"
    gossip_wait: float = 10.0
    #: Group runs averaging gradients: Bagua's communication delay (hivemind's delayed
    #: gradient averaging and optimizer step): an epoch's gradients are averaged while the
    #: next epoch computes, and applied one epoch late (staleness one epoch). State runs
    #: average in the background already; gossip runs delay with ``gossip_mode = "async"``.
    delayed_averaging: bool = False
    schema: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if not self.run or not self.run.replace("-", "").replace("_", "").isalnum():
            raise SpecError(f"run name {self.run!r}: use letters, digits, '-' and '_'")
        if self.compression not in COMPRESSION_NAMES:
            raise SpecError(f"compression {self.compression!r} is not one of {COMPRESSION_NAMES}")
        if self.optimizer not in ("adam", "sgd"):
            raise SpecError(f"optimizer {self.optimizer!r} is not adam or sgd")
        if self.averaging not in ("gradients", "state", "gossip"):
            raise SpecError(f"averaging {self.averaging!r} is not gradients, state or gossip")
        if self.gossip_topology not in GOSSIP_TOPOLOGIES:
            raise SpecError(
                f"gossip_topology {self.gossip_topology!r} is not one of {GOSSIP_TOPOLOGIES}"
            )
        if self.gossip_mode not in GOSSIP_MODES:
            raise SpecError(f"gossip_mode {self.gossip_mode!r} is not one of {GOSSIP_MODES}")
        if not all(isinstance(v, bool) for v in (self.verified_averaging, self.delayed_averaging)):
            raise SpecError("verified_averaging and delayed_averaging are true or false")
        if self.delayed_averaging and self.averaging != "gradients":
            raise SpecError(
                "delayed_averaging is for runs averaging gradients: state averaging runs in "
                "the background already, and a gossip run delays with gossip_mode async"
            )
        if self.target_batch_size < 1 or self.batch_size < 1 or self.shards < 1:
            raise SpecError("target_batch_size, batch_size and shards must be >= 1")
        timeouts = (
            self.matchmaking_time,
            self.averaging_timeout,
            self.allreduce_timeout,
            self.next_chunk_timeout,
            self.load_state_timeout,
            self.gossip_wait,
        )
        if not all(t > 0 for t in timeouts):
            raise SpecError("every averaging timeout must be > 0 (unbounded waits are refused)")

    @property
    def swarm(self) -> str:
        """This run's name in hivemind's own keys (:func:`swarm_name`)."""
        return swarm_name(self.run, self.verified_averaging)

    def canonical(self) -> bytes:
        """The bytes that are signed: sorted-key JSON of every field."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, data: Any) -> RunRecord:
        if not isinstance(data, dict):
            raise RunRecordError("run record is not a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RunRecordError(f"run record has unknown fields {unknown} (a newer flotilla?)")
        if data.get("schema") not in READABLE_SCHEMAS:
            raise RunRecordError(
                f"run record schema {data.get('schema')!r}; this flotilla reads "
                f"{', '.join(map(str, READABLE_SCHEMAS))}"
            )
        try:
            return cls(**data)
        except (TypeError, SpecError) as exc:
            raise RunRecordError(f"run record is malformed: {exc}") from exc


@dataclass(frozen=True, slots=True)
class SignedRecord:
    """A record as stored in the DHT: its JSON, the signature, and the signer's key."""

    record_json: str
    signature: str
    public_key: str

    def to_wire(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, value: Any) -> SignedRecord:
        if not isinstance(value, dict) or set(value) != {"record_json", "signature", "public_key"}:
            raise RunRecordError("run record in the DHT is not a signed flotilla record")
        if not all(isinstance(v, str) for v in value.values()):
            raise RunRecordError("run record in the DHT has non-text fields")
        return cls(**value)


def sign_record(record: RunRecord, key: Ed25519PrivateKey) -> SignedRecord:
    body = record.canonical()
    return SignedRecord(
        record_json=body.decode(),
        signature=base64.b64encode(key.sign(body)).decode(),
        public_key=public_key_text(key.public_key()),
    )


def verify_record(signed: SignedRecord, trusted_key: str | None = None) -> RunRecord:
    """The record, if its signature verifies (and it was signed by ``trusted_key``, if given)."""
    if trusted_key is not None and signed.public_key != trusted_key:
        raise RunRecordError(
            f"run record is signed by {signed.public_key}, not the coordinator key {trusted_key}"
        )
    try:
        key = Ed25519PublicKey.from_public_bytes(base64.b64decode(signed.public_key))
        key.verify(base64.b64decode(signed.signature), signed.record_json.encode())
    except (InvalidSignature, ValueError) as exc:
        raise RunRecordError(
            "run record has a bad signature: it was altered after signing or not signed by "
            f"its claimed coordinator {signed.public_key}; refusing to train"
        ) from exc
    try:
        data = json.loads(signed.record_json)
    except json.JSONDecodeError as exc:
        raise RunRecordError(f"run record is not JSON: {exc}") from exc
    record = RunRecord.from_dict(data)
    if record.canonical() != signed.record_json.encode():
        raise RunRecordError("run record's JSON is not in canonical form")
    return record


def public_key_text(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def load_or_create_key(path: Path) -> Ed25519PrivateKey:
    """The coordinator's signing key, created (mode 0600) on first use."""
    if path.exists():
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise RunRecordError(f"{path} does not hold an Ed25519 private key")
        return key
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(pem)
    return key
