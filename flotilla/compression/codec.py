"""The codec seam: a protocol, the encoding context, and the per-tensor wire envelope.

A codec turns one float tensor into named *pieces* (small numpy arrays whose dtypes and
shapes depend only on the element count), and back. Because the pieces' layout is known
from the model's layout alone, a decoder checks every size before it allocates anything.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np

from flotilla.core.errors import SpecError, UpdateRejected, WireError
from flotilla.core.tensors import (
    DTYPES,
    MAX_DIMS,
    TensorSpec,
    all_finite,
    encode_state,
    read_header,
    read_metadata,
)

#: The ``format`` value in every codec payload's ``__metadata__``.
FORMAT = "flotilla.compression/1"
#: Largest tensor a standalone ``Codec.decode`` will allocate unless told otherwise.
DEFAULT_MAX_ELEMENTS = 1 << 28
#: float32's largest finite value.
F32_MAX = float(np.finfo(np.float32).max)

Pieces = dict[str, np.ndarray]


@dataclass(frozen=True)
class CodecContext:
    """Randomness for the stochastic codecs (qsgd rounding, randk seeds).

    Pass a seeded one to replay an encoding; the default draws fresh OS entropy.
    """

    rng: np.random.Generator = field(default_factory=np.random.default_rng)

    @classmethod
    def seeded(cls, seed: int) -> CodecContext:
        return cls(np.random.default_rng(seed))


class Codec(Protocol):
    """What the platform needs from an update codec."""

    @property
    def name(self) -> str: ...

    def params(self) -> dict[str, Any]:
        """The codec's parameters as JSON-able values (recorded in every payload)."""
        ...

    def pieces(self, n: int) -> tuple[TensorSpec, ...]:
        """The wire pieces for a tensor of ``n`` elements (names without a prefix)."""
        ...

    def encode_pieces(self, flat: np.ndarray, ctx: CodecContext) -> Pieces:
        """Encode a finite, contiguous, 1-D float32 array."""
        ...

    def decode_pieces(self, pieces: Mapping[str, np.ndarray], n: int) -> np.ndarray:
        """Decode pieces already checked against ``pieces(n)``; WireError on bad content."""
        ...

    def encode(self, tensor: np.ndarray, ctx: CodecContext | None = None) -> bytes: ...

    def decode(
        self, payload: bytes | bytearray | memoryview, *, max_elements: int = ...
    ) -> np.ndarray: ...


def as_flat_f32(value: np.ndarray, name: str) -> np.ndarray:
    """A contiguous 1-D float32 copy-or-view of a real tensor; refuses NaN/Inf."""
    arr = np.asarray(value)
    if arr.dtype.kind not in "fiub":
        raise TypeError(f"tensor {name!r}: cannot compress dtype {arr.dtype}")
    with np.errstate(over="ignore", invalid="ignore"):
        flat = np.ascontiguousarray(arr.astype(np.float32, copy=False).reshape(-1))
    if not all_finite(flat):
        raise UpdateRejected(f"tensor {name!r} contains NaN or Inf (as float32); not encoded")
    return flat


class WireCodec:
    """Standalone, self-describing payloads for one tensor, built on the piece methods."""

    name: ClassVar[str]

    def params(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def pieces(self, n: int) -> tuple[TensorSpec, ...]:
        raise NotImplementedError

    def encode_pieces(self, flat: np.ndarray, ctx: CodecContext) -> Pieces:
        raise NotImplementedError

    def decode_pieces(self, pieces: Mapping[str, np.ndarray], n: int) -> np.ndarray:
        raise NotImplementedError

    def encode(self, tensor: np.ndarray, ctx: CodecContext | None = None) -> bytes:
        """safetensors bytes: the pieces, plus codec, params and shape in ``__metadata__``."""
        arr = np.asarray(tensor)
        pieces = self.encode_pieces(as_flat_f32(arr, "tensor"), ctx or CodecContext())
        meta = codec_metadata(self)
        meta["shape"] = json.dumps(list(arr.shape))
        return encode_state(pieces, meta)

    def decode(
        self, payload: bytes | bytearray | memoryview, *, max_elements: int = DEFAULT_MAX_ELEMENTS
    ) -> np.ndarray:
        """A float32 tensor from ``encode``'s bytes; WireError on anything malformed."""
        meta = read_metadata(payload, len(payload))
        check_codec_metadata(meta, self)
        shape = _shape(meta.get("shape"), max_elements)
        n = math.prod(shape)
        views = piece_views(payload, self.pieces(n), len(payload))
        return self.decode_pieces(views, n).reshape(shape)


def piece_views(
    payload: bytes | bytearray | memoryview, expected: tuple[TensorSpec, ...], max_bytes: int
) -> dict[str, np.ndarray]:
    """Read-only views of a payload's pieces, after checking them against ``expected``."""
    specs, spans, start = read_header(payload, max_bytes)
    check_pieces({s.name: s for s in specs}, expected)
    view = memoryview(payload).toreadonly()
    return {
        spec.name: np.frombuffer(view[start + b : start + e], DTYPES[spec.dtype]).reshape(
            spec.shape
        )
        for spec, (b, e) in zip(specs, spans, strict=True)
    }


def codec_metadata(codec: Codec) -> dict[str, str]:
    """The ``__metadata__`` that names a codec and its parameters."""
    return {
        "format": FORMAT,
        "codec": codec.name,
        "params": json.dumps(codec.params(), sort_keys=True, separators=(",", ":")),
    }


def read_codec_metadata(meta: Mapping[str, str]) -> tuple[str, dict[str, Any]]:
    """Codec name and parameters from a payload's metadata; WireError if absent or malformed."""
    if meta.get("format") != FORMAT:
        raise WireError(f"not a {FORMAT} payload (format {meta.get('format')!r})")
    name, raw = meta.get("codec"), meta.get("params")
    if name is None or raw is None:
        raise WireError("codec payload metadata lacks 'codec' or 'params'")
    try:
        params = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise WireError(f"codec params are not valid JSON: {exc}") from exc
    if not isinstance(params, dict):
        raise WireError("codec params must be a JSON object")
    return name, params


def check_codec_metadata(meta: Mapping[str, str], codec: Codec) -> None:
    name, params = read_codec_metadata(meta)
    if name != codec.name or params != codec.params():
        raise WireError(
            f"payload was encoded with codec {name[:40]!r} {str(params)[:200]}, "
            f"expected {codec.name!r} {codec.params()}"
        )


def check_pieces(got: Mapping[str, TensorSpec], expected: tuple[TensorSpec, ...]) -> None:
    """Refuse pieces whose names, dtypes or shapes differ from what the layout implies."""
    want = {s.name: s for s in expected}
    if len(got) != len(want) or set(got) != set(want):
        missing = [k[:80] for k in sorted(set(want) - set(got))[:5]]
        extra = [k[:80] for k in sorted(set(got) - set(want))[:5]]
        raise WireError(f"codec pieces differ: missing {missing}, unexpected {extra}")
    for key, spec in want.items():
        other = got[key]
        if other.dtype != spec.dtype or tuple(other.shape) != spec.shape:
            raise WireError(
                f"piece {key!r}: {other.dtype}{list(other.shape)}, "
                f"expected {spec.dtype}{list(spec.shape)}"
            )


def _shape(raw: str | None, max_elements: int) -> tuple[int, ...]:
    try:
        shape = json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError) as exc:
        raise WireError(f"payload shape is not valid JSON: {exc}") from exc
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise WireError(f"payload shape {raw!r} is not a list of sizes")
    if math.prod(max(d, 1) for d in shape) > max_elements:
        raise WireError(f"payload shape {shape} exceeds {max_elements} elements")
    return tuple(shape)


# --- parameter checks (SpecError names the parameter) ----------------------------------------


def check_int(codec: str, param: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SpecError(
            f"codec {codec!r}: parameter {param!r} must be an integer in [{low}, {high}], "
            f"got {value!r:.40}"
        )


def check_fraction(codec: str, param: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        ok = False
    elif isinstance(value, int):  # JSON may carry huge ints; float() of those overflows
        ok = value == 1
    else:
        ok = 0.0 < value <= 1.0  # False for NaN
    if not ok:
        raise SpecError(
            f"codec {codec!r}: parameter {param!r} must be a number in (0, 1], got {value!r:.40}"
        )


def check_choice(codec: str, param: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SpecError(
            f"codec {codec!r}: parameter {param!r} must be one of {list(choices)}, "
            f"got {value!r:.40}"
        )


def check_bool(codec: str, param: str, value: object) -> None:
    if not isinstance(value, bool):
        raise SpecError(f"codec {codec!r}: parameter {param!r} must be true or false")


def count_of(fraction: float, n: int) -> int:
    """Elements a sparse codec keeps: ``max(1, round(fraction * n))`` capped at ``n``."""
    if n <= 0:
        return 0
    return min(n, max(1, math.floor(fraction * n + 0.5)))
