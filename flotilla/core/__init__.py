"""Shared types every other part speaks. Imports nothing else of Flotilla, and no torch.

- ``errors``: the :class:`FlotillaError` tree.
- ``access``: :class:`Scope`, what a token allows (operator or read).
- ``spec``: :class:`JobSpec` from TOML, unknown fields refused by name.
- ``tables``: :func:`build_dataclass`, plain data onto checked dataclasses.
- ``jobfile``: job files (one job, or ``[[jobs]]``), as ``flotilla job submit`` reads them.
- ``tensors``: model states and the safe safetensors wire format.
- ``blobs``: chunking and SHA-256 checking of blobs in transit.
- ``blobstore``: :class:`BlobStore`, content-addressed checkpoints on disk.
- ``update``: :class:`Update`, one device's contribution to a round.
- ``device``: :class:`DeviceProfile`.
- ``conditions``: :class:`DeviceConditions`, battery, power, network and heat at each poll.
- ``eligibility``: a job's ``[eligibility]`` policy and the one function that judges it.
- ``measure``: what a device measures about itself (matmul speed, memory) to enrol.
- ``records``: the durable rows (jobs, rounds, participations, devices).
- ``commit_rules``: what every ledger enforces on round commits and job states.
- ``round_config``: :class:`RoundConfig`, the config a training task carries, parsed.
- ``timeouts``: :class:`Timeouts`, every network and process wait in one place.
- ``files``: private files for secrets.
- ``identity``: :class:`DeviceIdentity` (a device's Ed25519 key) and the one signed
  statement of an update (imported where used: it loads ``cryptography``).
"""

from flotilla.core.blobs import CHUNK_BYTES, BlobAssembler, iter_chunks, sha256_hex
from flotilla.core.blobstore import BlobStore
from flotilla.core.conditions import DeviceConditions
from flotilla.core.device import DeviceProfile
from flotilla.core.errors import (
    AuthError,
    FlotillaError,
    IntegrityError,
    NotFoundError,
    SpecError,
    StaleRoundError,
    TaskLoadError,
    UpdateRejected,
    WireError,
)
from flotilla.core.records import (
    JOB_STATES,
    TERMINAL_STATES,
    DeviceRecord,
    JobRecord,
    ParticipationRecord,
    RoundCommit,
    RoundRecord,
)
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import (
    FlatState,
    ModelState,
    TensorSpec,
    check_finite,
    check_layout,
    decode_state,
    encode_state,
    encode_state_parts,
    state_nbytes,
    state_sha256,
    state_spec,
)
from flotilla.core.timeouts import Timeouts
from flotilla.core.update import Update

__all__ = [
    "CHUNK_BYTES",
    "JOB_STATES",
    "TERMINAL_STATES",
    "AuthError",
    "BlobAssembler",
    "BlobStore",
    "DeviceConditions",
    "DeviceProfile",
    "DeviceRecord",
    "FlatState",
    "FlotillaError",
    "IntegrityError",
    "JobRecord",
    "JobSpec",
    "ModelState",
    "NotFoundError",
    "ParticipationRecord",
    "RoundCommit",
    "RoundRecord",
    "SpecError",
    "StaleRoundError",
    "TaskLoadError",
    "TensorSpec",
    "Timeouts",
    "Update",
    "UpdateRejected",
    "WireError",
    "check_finite",
    "check_layout",
    "decode_state",
    "encode_state",
    "encode_state_parts",
    "iter_chunks",
    "sha256_hex",
    "state_nbytes",
    "state_sha256",
    "state_spec",
]
