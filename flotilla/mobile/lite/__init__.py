"""The torch-free reference client (``flotilla-lite``): standard library, NumPy and
``flotilla.core`` only; no torch, no grpc. It stands in for a phone SDK and shows what one
must do.

- ``mlp``: the digits task's MLP, cross-entropy and SGD in NumPy, matching the torch task
  (same parameter names, same batch order from the round's seed).
- ``codecs``: the uplink codecs a device writes (``none``, ``fp16``, ``bf16``, ``int8``),
  byte for byte the server's format; :func:`supported_codecs`.
- ``rounds``: :class:`LiteTrainer`, a work order and the model's bytes in, the upload
  (:class:`LiteUpdate`) or why it stopped (:class:`Stopped`) out; ``unsupported`` names
  what this device cannot do before it tries. Its local training is a
  :class:`LocalTraining`: :class:`MlpTraining` (NumPy) by default.
- ``program``: ``ProgramTraining``, the other :class:`LocalTraining`: rounds through an
  exported ExecuTorch program (``--program DIR``). Not imported here: it is the one module
  that reaches ExecuTorch and torch (through ``flotilla.mobile.runtime``, lazily).
- ``data``: the shard file ``flotilla data shard`` writes, read strictly.
- ``conditions``: the ``--conditions`` file and the job's ``[eligibility]`` policy, as a
  ``should_stop`` check between batches.
- ``state``: ``--state-dir``: the credential, transfers in progress, per-job state.
- ``http``: :class:`~flotilla.mobile.lite.http.HttpDevice`, the device side of the HTTP
  device protocol, standard library only.
- ``__main__``: the ``flotilla-lite`` command line.

The HTTP device protocol itself is docs/protocol.md.
"""

from flotilla.mobile.lite.codecs import LiteCodec, supported_codecs
from flotilla.mobile.lite.conditions import LiteConditions, job_policy, stop_check
from flotilla.mobile.lite.data import ShardFile, ShardInfo, read_shard, write_shard
from flotilla.mobile.lite.mlp import TASKS, DigitsModel, Stopped
from flotilla.mobile.lite.rounds import (
    JobStates,
    LiteTrainer,
    LiteUpdate,
    LocalTraining,
    MemoryJobStates,
    MlpTraining,
)
from flotilla.mobile.lite.state import LiteState

__all__ = [
    "TASKS",
    "DigitsModel",
    "JobStates",
    "LiteCodec",
    "LiteConditions",
    "LiteState",
    "LiteTrainer",
    "LiteUpdate",
    "LocalTraining",
    "MemoryJobStates",
    "MlpTraining",
    "ShardFile",
    "ShardInfo",
    "Stopped",
    "job_policy",
    "read_shard",
    "stop_check",
    "supported_codecs",
    "write_shard",
]
