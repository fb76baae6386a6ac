"""The manifest beside an exported training program: what a device app needs to drive it.

A Kotlin or Swift app reads ``manifest.json`` to know which method to call with which
inputs, how the program's parameters map to the model's names on the wire (the
safetensors names the server sends and expects back), the job's local optimiser settings,
and SHA-256s to check that the program and its weights are the ones exported. Plain JSON,
versioned; reading it needs neither torch nor ExecuTorch.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from flotilla.core.errors import SpecError
from flotilla.core.tables import build_dataclass
from flotilla.core.tensors import DTYPES

#: Bumped when a field changes meaning or goes away; readers refuse versions they do not know.
MANIFEST_VERSION = 1
#: The HTTP device protocol (``/device/v1/``) a device uses to fetch models and send updates.
DEVICE_PROTOCOL_VERSION = 1
#: The files ``flotilla job export --format executorch --out DIR`` writes in DIR.
PROGRAM_FILE = "model.pte"
MANIFEST_FILE = "manifest.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _sha(value: str, what: str) -> None:
    if not _SHA256.fullmatch(value):
        raise SpecError(f"{what} must be 64 lowercase hex digits, got {value!r}")


def _dtype(value: str, what: str) -> None:
    if value not in DTYPES:
        raise SpecError(f"{what}: dtype {value!r} is not one of {', '.join(DTYPES)}")


def _shape(shape: tuple[int, ...], what: str) -> None:
    if any(d < 0 for d in shape):
        raise SpecError(f"{what}: shape {list(shape)} has a negative dimension")


@dataclass(frozen=True, slots=True)
class ParameterEntry:
    """One trained tensor: its wire name, its name inside the program, and its initial value's
    SHA-256 (of the C-order little-endian bytes, as safetensors stores them)."""

    name: str
    program_name: str
    shape: tuple[int, ...]
    dtype: str
    sha256: str

    def __post_init__(self) -> None:
        _shape(self.shape, f"parameter {self.name!r}")
        _dtype(self.dtype, f"parameter {self.name!r}")
        _sha(self.sha256, f"parameter {self.name!r} sha256")


@dataclass(frozen=True, slots=True)
class BatchInput:
    """One input of the training method, per example: the batch dimension comes first and
    may be anything from 1 to ``ProgramInfo.max_batch``."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        _shape(self.shape, f"input {self.name!r}")
        _dtype(self.dtype, f"input {self.name!r}")


@dataclass(frozen=True, slots=True)
class ProgramInfo:
    """The ``.pte`` file: which method trains, what it returns, and the file's SHA-256."""

    file: str
    format: str
    sha256: str
    size: int
    #: Runs forward and backward: outputs ``outputs`` first, then gradients and parameters
    #: (ExecuTorch's ``TrainingModule.forward_backward`` splits them).
    method: str
    #: The user outputs in order; the first is always ``loss``.
    outputs: tuple[str, ...]
    max_batch: int
    executorch_version: str
    torch_version: str

    def __post_init__(self) -> None:
        _sha(self.sha256, "program sha256")
        if not self.outputs or self.outputs[0] != "loss":
            raise SpecError(f"program outputs must start with 'loss', got {list(self.outputs)}")
        if self.max_batch < 1 or self.size < 0:
            raise SpecError("program max_batch must be >= 1 and size >= 0")


@dataclass(frozen=True, slots=True)
class TrainingSettings:
    """The job's local training, as its devices run it (``[train]`` of the job spec)."""

    optimizer: str
    learning_rate: float
    momentum: float
    weight_decay: float
    local_epochs: int
    batch_size: int
    #: Momentum over rounds on the device's update before it is sent (0: the plain delta).
    update_momentum: float


@dataclass(frozen=True, slots=True)
class ExportManifest:
    """``manifest.json`` of ``flotilla job export --format executorch``."""

    manifest_version: int
    protocol_version: int
    task: str
    job_id: str
    #: The committed round whose model the program holds (0: the initial model).
    round: int
    #: SHA-256 of that model as the server stores and serves it (the device protocol's ETag).
    model_sha256: str
    program: ProgramInfo
    #: The training method's inputs in call order.
    inputs: tuple[BatchInput, ...]
    #: Every tensor of the model's state, in wire order; all are trained.
    parameters: tuple[ParameterEntry, ...]
    training: TrainingSettings

    def __post_init__(self) -> None:
        if self.manifest_version != MANIFEST_VERSION:
            raise SpecError(
                f"manifest version {self.manifest_version} is not supported "
                f"(this flotilla reads version {MANIFEST_VERSION})"
            )
        _sha(self.model_sha256, "model_sha256")
        if self.round < 0:
            raise SpecError(f"round must be >= 0, got {self.round}")
        for what, names in (
            ("parameter", [p.name for p in self.parameters]),
            ("program parameter", [p.program_name for p in self.parameters]),
            ("input", [i.name for i in self.inputs]),
        ):
            if len(set(names)) != len(names):
                raise SpecError(f"manifest names a {what} twice: {names}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))  # type: ignore[no-any-return]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<manifest>") -> ExportManifest:
        """Strict: an unknown, missing or ill-typed field is a SpecError that names it."""
        _require_all(cls, data, source, "")
        return build_dataclass(cls, data, source)

    @classmethod
    def read(cls, path: Path) -> ExportManifest:
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SpecError(f"{path}: not a readable JSON manifest: {exc}") from exc
        if not isinstance(data, dict):
            raise SpecError(f"{path}: a manifest is a JSON object")
        return cls.from_dict(data, str(path))


def _require_all(cls: type[Any], data: Any, source: str, prefix: str) -> None:
    """Every field present, at every depth: a manifest has no defaults to fall back on."""
    if not isinstance(data, Mapping):
        return  # build_dataclass names the wrong type
    hints = get_type_hints(cls)
    missing = [name for name in hints if name not in data]
    if missing:
        raise SpecError(f"{source}: missing field(s) {', '.join(prefix + m for m in missing)}")
    for name, hint in hints.items():
        value = data[name]
        if dataclasses.is_dataclass(hint):
            _require_all(hint, value, source, f"{prefix}{name}.")  # type: ignore[arg-type]
        item = (get_args(hint) or (None,))[0]
        if get_origin(hint) is tuple and dataclasses.is_dataclass(item) and isinstance(value, list):
            for i, entry in enumerate(value):
                _require_all(item, entry, source, f"{prefix}{name}[{i}].")  # type: ignore[arg-type]
