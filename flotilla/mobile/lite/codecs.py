"""The update codecs a light device writes, in NumPy, byte for byte as ``flotilla.compression``
writes them (the server decodes them with its own decoder; a test holds the two together).

An update is safetensors bytes. With codec ``none`` it is the plain delta, tensor by tensor.
Otherwise every tensor ``t`` travels as pieces ``t::p`` (``fp16``: ``data`` F16; ``bf16``:
``bits`` U16; ``int8``: ``scale`` F32 per block of ``block_size`` values, then ``q`` I8),
and ``__metadata__`` says ``format = "flotilla.compression/1"``, the codec and its
parameters (compact, sorted JSON). Written out here rather than imported, so this package
shows what a client in another language must do, and stays torch-free by construction.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from flotilla.core.errors import SpecError, UpdateRejected, WireError
from flotilla.core.tensors import (
    ModelState,
    TensorSpec,
    decode_state,
    encode_state,
    read_header,
    read_metadata,
)

FORMAT = "flotilla.compression/1"
SEP = "::"
#: The codecs this device writes, with their parameters' defaults.
_DEFAULTS: Mapping[str, Mapping[str, int]] = {
    "none": {}, "fp16": {}, "bf16": {}, "int8": {"block_size": 256},
}  # fmt: skip
F16_MAX = 65504.0
F32_MAX = float(np.finfo(np.float32).max)
_TINY = np.float32(np.finfo(np.float32).tiny)
_INT8_LEVELS = 127
_MAX_BLOCK = 1 << 24
#: Room for a payload's header beyond its pieces' bytes when reading one.
_HEADER_SLACK = 1 << 20


def supported_codecs() -> tuple[str, ...]:
    """The codec names this device can encode (and decode, for a compressed broadcast)."""
    return tuple(_DEFAULTS)


@dataclass(frozen=True, slots=True)
class LiteCodec:
    """One codec with its parameters, as a job names it; :meth:`make` checks both."""

    name: str
    block_size: int = 0

    @classmethod
    def make(cls, name: str, params: Mapping[str, Any] | None = None) -> LiteCodec:
        """SpecError naming what this device cannot do (a codec, a parameter)."""
        defaults = _DEFAULTS.get(name)
        if defaults is None:
            raise SpecError(
                f"flotilla-lite cannot encode codec {name!r}; "
                f"it supports {', '.join(supported_codecs())}"
            )
        given = dict(params or {})
        unknown = sorted(set(given) - set(defaults))
        if unknown:
            raise SpecError(f"codec {name!r}: unknown parameter {unknown[0]!r}")
        block = given.get("block_size", defaults.get("block_size", 0))
        if name == "int8" and (
            isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= _MAX_BLOCK
        ):
            raise SpecError(f"codec 'int8': block_size must be an integer in [1, {_MAX_BLOCK}]")
        return cls(name, block)

    def params(self) -> dict[str, int]:
        return {"block_size": self.block_size} if self.name == "int8" else {}

    def metadata(self) -> dict[str, str]:
        params = json.dumps(self.params(), sort_keys=True, separators=(",", ":"))
        return {"format": FORMAT, "codec": self.name, "params": params}

    def pieces(self, n: int) -> tuple[TensorSpec, ...]:
        """The pieces of an ``n``-element tensor, in wire order."""
        if self.name == "int8":
            blocks = -(-n // self.block_size)
            return (TensorSpec("scale", "F32", (blocks,)), TensorSpec("q", "I8", (n,)))
        dtype = {"none": "F32", "fp16": "F16", "bf16": "U16"}[self.name]
        return (TensorSpec("bits" if self.name == "bf16" else "data", dtype, (n,)),)

    def encode_pieces(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Pieces of a finite, contiguous, 1-D float32 array."""
        if self.name == "int8":
            scale, q = _absmax_int8(flat, self.block_size)
            return {"scale": scale, "q": q}
        if self.name == "fp16":
            return {"data": _to_f16(flat)}
        if self.name == "bf16":
            return {"bits": _to_bf16_bits(flat)}
        return {"data": flat}

    def decode_pieces(self, pieces: Mapping[str, np.ndarray], n: int) -> np.ndarray:
        """float32 values from pieces already checked against :meth:`pieces`."""
        if self.name == "int8":
            return _int8_values(pieces["q"], pieces["scale"], self.block_size)
        if self.name == "bf16":
            bits = pieces["bits"]
            if ((bits & np.uint16(0x7F80)) == np.uint16(0x7F80)).any():
                raise WireError("bf16: payload holds NaN or Inf")
            out: np.ndarray = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
            return out
        data = pieces["data"]
        if not np.isfinite(data).all():
            raise WireError(f"{self.name}: payload holds NaN or Inf")
        return np.array(data, dtype=np.float32)


def encode_update(
    codec: LiteCodec, delta: Mapping[str, np.ndarray], residuals: ModelState | None = None
) -> tuple[bytes, ModelState | None]:
    """The upload for ``delta`` and, with error feedback (``residuals`` given, possibly
    empty), the new residuals: ``target = delta + residual``, sent ``C(target)``, kept
    ``target - decode(C(target))``. A residual of another shape is dropped."""
    if codec.name == "none":
        plain = {k: _flat(k, v).reshape(np.shape(v)) for k, v in delta.items()}
        return encode_state(plain), residuals
    pieces: dict[str, np.ndarray] = {}
    kept: ModelState = {}
    for name, value in delta.items():
        shape = tuple(np.shape(value))
        target = _flat(name, value)
        held = None if residuals is None else residuals.get(name)
        if held is not None and held.shape == shape:
            target = target + held.reshape(-1).astype(np.float32)
        encoded = codec.encode_pieces(target)
        if residuals is not None:
            kept[name] = (target - codec.decode_pieces(encoded, target.size)).reshape(shape)
        for spec in codec.pieces(target.size):
            pieces[f"{name}{SEP}{spec.name}"] = encoded[spec.name]
    return encode_state(pieces, codec.metadata()), (kept if residuals is not None else None)


def decode_payload(
    payload: bytes | bytearray | memoryview, codec: LiteCodec, layout: tuple[TensorSpec, ...]
) -> ModelState:
    """A codec payload (a compressed broadcast) as float32 tensors in ``layout``; WireError
    on any payload whose codec, pieces or values are not what ``codec`` and ``layout`` say."""
    expected = tuple(
        TensorSpec(f"{s.name}{SEP}{p.name}", p.dtype, p.shape)
        for s in layout
        for p in codec.pieces(math.prod(s.shape))
    )
    limit = sum(s.nbytes for s in expected) + _HEADER_SLACK
    found = _codec_of(read_metadata(payload, limit))
    if found != codec:
        raise WireError(f"payload metadata names codec {found}, the job's is {codec}")
    specs, _, _ = read_header(payload, limit)
    if sorted(specs, key=lambda s: s.name) != sorted(expected, key=lambda s: s.name):
        raise WireError("payload pieces differ from what the codec writes for the model")
    views = decode_state(payload, expected, limit)
    out: ModelState = {}
    for spec in layout:
        n = math.prod(spec.shape)
        mine = {p.name: views[f"{spec.name}{SEP}{p.name}"] for p in codec.pieces(n)}
        out[spec.name] = codec.decode_pieces(mine, n).reshape(spec.shape)
    return out


def _codec_of(meta: Mapping[str, str]) -> LiteCodec:
    """The codec a payload's ``__metadata__`` names; WireError if none this device knows."""
    if meta.get("format") != FORMAT:
        raise WireError(f"payload metadata: format {meta.get('format')!r:.40}, not {FORMAT!r}")
    try:
        params = json.loads(meta.get("params", "{}"))
        if not isinstance(params, dict):
            raise ValueError("params must be a JSON object")
        return LiteCodec.make(str(meta.get("codec")), params)
    except (ValueError, RecursionError) as exc:  # SpecError is a ValueError
        raise WireError(f"payload metadata names no codec this device reads: {exc}") from exc


def _flat(name: str, value: np.ndarray) -> np.ndarray:
    """A contiguous 1-D float32 copy of a finite tensor (a NaN is never encoded)."""
    with np.errstate(over="ignore", invalid="ignore"):
        flat = np.ascontiguousarray(np.asarray(value).astype(np.float32).reshape(-1))
    if not np.isfinite(flat).all():
        raise UpdateRejected(f"tensor {name!r} contains NaN or Inf (as float32); not encoded")
    return flat


def _to_f16(x: np.ndarray) -> np.ndarray:
    """float16, saturating at +-65504 rather than overflowing to infinity."""
    half: np.ndarray = np.clip(x, -F16_MAX, F16_MAX).astype(np.float16)
    return half


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bits, rounded to nearest even; +-inf after rounding becomes +-max."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + (((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF))
    out: np.ndarray = (rounded >> np.uint32(16)).astype(np.uint16)
    overflow = (out & np.uint16(0x7FFF)) == np.uint16(0x7F80)
    out[overflow] -= np.uint16(1)
    return out


def _absmax_int8(flat: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Per block: ``scale = absmax / 127`` (float32) and ``q = rint(x * (1 / scale))``; a
    block whose scale has no float32 reciprocal divides in float64 instead."""
    n = flat.size
    padded = np.zeros(-(-n // block) * block, np.float32)
    padded[:n] = flat
    x = padded.reshape(-1, block)
    # Zero padding cannot change a block's absmax (it is >= 0 anyway).
    absmax = np.maximum(x.max(axis=1, initial=0.0), -x.min(axis=1, initial=0.0))
    scale = (absmax / np.float32(_INT8_LEVELS)).astype(np.float32)
    normal = scale >= _TINY
    inv = np.zeros_like(scale)
    np.divide(np.float32(1), scale, out=inv, where=normal)
    q = np.rint(x * inv[:, None]).astype(np.int8)
    for row in np.flatnonzero((scale > 0) & ~normal):
        exact = x[row].astype(np.float64) / np.float64(scale[row])
        q[row] = np.clip(np.rint(exact), -_INT8_LEVELS, _INT8_LEVELS).astype(np.int8)
    return scale, q.reshape(-1)[:n]


def _int8_values(q: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    if not ((scale >= 0) & (scale <= np.float32(F32_MAX / _INT8_LEVELS))).all():
        raise WireError("int8: block scale is NaN, negative or out of range")
    if q.size and int(q.min()) < -_INT8_LEVELS:
        raise WireError("int8: a value of -128 is never encoded")
    out = q.astype(np.float32)
    out *= np.repeat(scale, block)[: q.size]
    return out
