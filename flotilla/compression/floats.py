"""Float codecs: ``none`` (float32 as is), ``fp16`` and ``bf16`` (16 bits per value)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from flotilla.compression.bits import bf16_bits_to_f32, f32_to_bf16_bits
from flotilla.compression.codec import CodecContext, Pieces, WireCodec
from flotilla.core.errors import WireError
from flotilla.core.tensors import TensorSpec, all_finite

#: float16's largest finite value: fp16 saturates here instead of overflowing to infinity.
F16_MAX = 65504.0


@dataclass(frozen=True)
class NoneCodec(WireCodec):
    """No compression: float32 values, exact; the baseline the others are measured against."""

    name: ClassVar[str] = "none"

    def pieces(self, n: int) -> tuple[TensorSpec, ...]:
        return (TensorSpec("data", "F32", (n,)),)

    def encode_pieces(self, flat: np.ndarray, ctx: CodecContext) -> Pieces:
        return {"data": flat}

    def decode_pieces(self, pieces: Mapping[str, np.ndarray], n: int) -> np.ndarray:
        data = pieces["data"]
        if not all_finite(data):
            raise WireError("none: payload holds NaN or Inf")
        return np.array(data, dtype=np.float32)


@dataclass(frozen=True)
class Fp16Codec(WireCodec):
    """IEEE half precision. Values beyond +-65504 saturate there (documented, not refused)."""

    name: ClassVar[str] = "fp16"

    def pieces(self, n: int) -> tuple[TensorSpec, ...]:
        return (TensorSpec("data", "F16", (n,)),)

    def encode_pieces(self, flat: np.ndarray, ctx: CodecContext) -> Pieces:
        return {"data": to_f16(flat)}

    def decode_pieces(self, pieces: Mapping[str, np.ndarray], n: int) -> np.ndarray:
        return from_f16(pieces["data"], "fp16")


@dataclass(frozen=True)
class Bf16Codec(WireCodec):
    """bfloat16 bits (float32's range, 8 significant bits), rounded to nearest even.

    numpy has no bfloat16, so the bits travel as U16; the codec name says what they mean.
    """

    name: ClassVar[str] = "bf16"

    def pieces(self, n: int) -> tuple[TensorSpec, ...]:
        return (TensorSpec("bits", "U16", (n,)),)

    def encode_pieces(self, flat: np.ndarray, ctx: CodecContext) -> Pieces:
        return {"bits": f32_to_bf16_bits(flat)}

    def decode_pieces(self, pieces: Mapping[str, np.ndarray], n: int) -> np.ndarray:
        bits = pieces["bits"]
        if ((bits & np.uint16(0x7F80)) == np.uint16(0x7F80)).any():
            raise WireError("bf16: payload holds NaN or Inf")
        return bf16_bits_to_f32(bits)


def to_f16(x: np.ndarray) -> np.ndarray:
    """float16 of finite float32 values, saturating at +-65504 rather than overflowing."""
    with np.errstate(over="ignore"):
        half = x.astype(np.float16)
    if _f16_nonfinite(half):
        half = np.clip(x, -F16_MAX, F16_MAX).astype(np.float16)
    return half


def from_f16(half: np.ndarray, codec: str) -> np.ndarray:
    if _f16_nonfinite(half):
        raise WireError(f"{codec}: payload holds NaN or Inf")
    return half.astype(np.float32)


def _f16_nonfinite(half: np.ndarray) -> bool:
    exponent = half.view(np.uint16) & np.uint16(0x7C00)
    return bool((exponent == np.uint16(0x7C00)).any())
