"""Quantising codecs: blockwise absmax ``int8`` and ``int4``, and stochastic ``qsgd``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from flotilla.compression.bits import (
    pack_codes,
    pack_nibbles,
    packed_size,
    unpack_codes,
    unpack_nibbles,
)
from flotilla.compression.codec import (
    F32_MAX,
    CodecContext,
    Pieces,
    WireCodec,
    check_choice,
    check_int,
)
from flotilla.core.errors import UpdateRejected, WireError
from flotilla.core.tensors import TensorSpec

#: Smallest normal float32: below it a block's scale has no reciprocal in float32.
_TINY = np.float32(np.finfo(np.float32).tiny)
_MAX_BLOCK = 1 << 24


def _blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


def absmax_quantize(
    flat: np.ndarray, block_size: int, levels: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per block: ``scale = absmax / levels`` and ``q = rint(x / scale)`` in ``[-levels, levels]``.

    The full blocks run as one (blocks, block_size) view, so the work is a few vectorised
    passes; blocks whose scale is subnormal are redone in float64 to keep the error bound.
    """
    n = flat.size
    nfull = n // block_size
    rows = [flat[: nfull * block_size].reshape(nfull, block_size)]
    if n % block_size:
        rows.append(flat[nfull * block_size :].reshape(1, -1))
    scales, qs = [], []
    for x in rows:
        absmax = np.maximum(x.max(axis=1), -x.min(axis=1)) if x.size else np.zeros(0, np.float32)
        scale = (absmax / np.float32(levels)).astype(np.float32)
        normal = scale >= _TINY
        inv = np.zeros_like(scale)
        np.divide(np.float32(1), scale, out=inv, where=normal)
        prod = x * inv[:, None]
        np.rint(prod, out=prod)
        q = prod.astype(np.int8)
        tiny = np.flatnonzero((scale > 0) & ~normal)
        if tiny.size:
            exact = x[tiny].astype(np.float64) / scale[tiny, None].astype(np.float64)
            q[tiny] = np.clip(np.rint(exact), -levels, levels).astype(np.int8)
        scales.append(scale)
        qs.append(q.reshape(-1))
    return np.concatenate(scales), np.concatenate(qs)


def absmax_dequantize(q: np.ndarray, scale: np.ndarray, block_size: int, levels: int) -> np.ndarray:
    """``q * scale`` per block, after refusing scales that are NaN, negative or too large."""
    if not ((scale >= 0) & (scale <= np.float32(F32_MAX / levels))).all():
        raise WireError("block scale is NaN, negative or out of range")
    n = q.size
    nfull = n // block_size
    out = q.astype(np.float32)
    main = out[: nfull * block_size].reshape(nfull, block_size)
    main *= scale[:nfull, None]
    if n % block_size:
        out[nfull * block_size :] *= scale[-1]
    return out


@dataclass(frozen=True)
class Int8Codec(WireCodec):
    """Blockwise absmax int8: 8 bits per value plus one float32 scale per block.

    Error per value <= absmax(block) / 254. The default block of 256 adds 0.125 bits/value.
    """

    name: ClassVar[str] = "int8"
    levels: ClassVar[int] = 127
    block_size: int = 256

    def __post_init__(self) -> None:
        check_int(self.name, "block_size", self.block_size, 1, _MAX_BLOCK)

    def pieces(self, n: int) -> tuple[TensorSpec, ...]:
        return (
            TensorSpec("scale", "F32", (_blocks(n, self.block_size),)),
            TensorSpec("q", "I8", (n,)),
        )

    def encode_pieces(self, flat: np.ndarray, ctx: CodecContext) -> Pieces:
        scale, q = absmax_quantize(flat, self.block_size, self.levels)
        return {"scale": scale, "q": q}

    def decode_pieces(self, pieces: Mapping[str, np.ndarray], n: int) -> np.ndarray:
        q = pieces["q"]
        if n and int(q.min()) < -self.levels:
            raise WireError("int8: a value of -128 is never encoded")
        return absmax_dequantize(q, pieces["scale"], self.block_size, self.levels)


@dataclass(frozen=True)
class Int4Codec(WireCodec):
    """Blockwise absmax 4-bit: values -7..7 stored as nibbles 1..15, two per byte.

    Error per value <= absmax(block) / 14. The default block of 64 adds 0.5 bits/value.
    """

    name: ClassVar[str] = "int4"
    levels: ClassVar[int] = 7
    block_size: int = 64

    def __post_init__(self) -> None:
        check_int(self.name, "block_size", self.block_size, 1, _MAX_BLOCK)

    def pieces(self, n: int) -> tuple[TensorSpec, ...]:
        return (
            TensorSpec("scale", "F32", (_blocks(n, self.block_size),)),
            TensorSpec("q", "U8", (-(-n // 2),)),
        )

    def encode_pieces(self, flat: np.ndarray, ctx: CodecContext) -> Pieces:
        scale, q = absmax_quantize(flat, self.block_size, self.levels)
        return {"scale": scale, "q": pack_nibbles((q + np.int8(8)).view(np.uint8))}

    def decode_pieces(self, pieces: Mapping[str, np.ndarray], n: int) -> np.ndarray:
        u = unpack_nibbles(pieces["q"], n)
        if n and int(u.min()) == 0:
            raise WireError("int4: nibble 0 (-8) is never encoded")
        q = u.view(np.int8) - np.int8(8)
        return absmax_dequantize(q, pieces["scale"], self.block_size, self.levels)


@dataclass(frozen=True)
class QsgdCodec(WireCodec):
    """QSGD (Alistarh et al. 2017): per bucket, ``norm * sign * level / s`` with the level
    rounded stochastically so that the decoded value is unbiased.

    Each value is one code ``sign*level + s`` in ``[0, 2s]``, packed in ceil(log2(2s+1))
    bits; one float32 norm per bucket. ``norm="l2"`` is the paper's; ``"max"`` (the
    bucket's absmax) has lower variance and never overflows float32.
    """

    name: ClassVar[str] = "qsgd"
    s: int = 7
    bucket_size: int = 512
    norm: Literal["l2", "max"] = "l2"

    def __post_init__(self) -> None:
        check_int(self.name, "s", self.s, 1, 127)
        check_int(self.name, "bucket_size", self.bucket_size, 1, _MAX_BLOCK)
        check_choice(self.name, "norm", self.norm, ("l2", "max"))

    @property
    def bits(self) -> int:
        return (2 * self.s).bit_length()

    def pieces(self, n: int) -> tuple[TensorSpec, ...]:
        return (
            TensorSpec("norm", "F32", (_blocks(n, self.bucket_size),)),
            TensorSpec("codes", "U8", (packed_size(n, self.bits),)),
        )

    def encode_pieces(self, flat: np.ndarray, ctx: CodecContext) -> Pieces:
        n, d, s = flat.size, self.bucket_size, self.s
        nb = _blocks(n, d)
        if n % d:
            padded = np.zeros(nb * d, np.float32)
            padded[:n] = flat
            flat = padded
        x = flat.reshape(nb, d)
        if self.norm == "l2":
            norm64 = np.sqrt(np.einsum("ij,ij->i", x, x, dtype=np.float64))
        else:
            norm64 = np.maximum(x.max(axis=1), -x.min(axis=1)).astype(np.float64)
        if nb and norm64.max() > F32_MAX:
            raise UpdateRejected("qsgd: a bucket's L2 norm exceeds float32; use norm='max'")
        norm = norm64.astype(np.float32)
        low = norm.astype(np.float64) < norm64  # round the stored norm up: levels stay <= s
        norm[low] = np.nextafter(norm[low], np.float32(np.inf))
        inv = np.where(norm64 > 0, s / np.maximum(norm.astype(np.float64), 1e-300), 0.0)
        tiny = np.flatnonzero(inv > 1e37)  # no float32 reciprocal: these rows go float64
        # r = |x| * s / norm in [0, s]; level = floor(r) + Bernoulli(frac(r)): E[level] = r.
        r = np.abs(x)
        r *= np.where(inv > 1e37, 0.0, inv).astype(np.float32)[:, None]
        if tiny.size:
            r[tiny] = (np.abs(x[tiny]).astype(np.float64) * inv[tiny, None]).astype(np.float32)
        level = np.floor(r)
        r -= level
        level += ctx.rng.random(r.shape, dtype=np.float32) < r
        np.minimum(level, np.float32(s), out=level)
        np.copysign(level, x, out=level)
        level += np.float32(s)
        codes = level.astype(np.uint8).reshape(-1)[:n]
        return {"norm": norm, "codes": pack_codes(codes, self.bits)}

    def decode_pieces(self, pieces: Mapping[str, np.ndarray], n: int) -> np.ndarray:
        norm, s, d = pieces["norm"], self.s, self.bucket_size
        if not ((norm >= 0) & (norm <= np.float32(F32_MAX))).all():
            raise WireError("qsgd: bucket norm is NaN, negative or out of range")
        codes = unpack_codes(pieces["codes"], self.bits, n)
        if n and int(codes.max()) > 2 * s:
            raise WireError(f"qsgd: code above {2 * s}")
        wide = norm.size and float(norm.max()) > 1e37  # float32 products could overflow
        levels = np.zeros(norm.size * d, np.float64 if wide else np.float32)
        levels[:n] = codes
        levels -= s
        step = norm.astype(np.float64) / s
        rows = levels.reshape(norm.size, d)
        rows *= step[:, None] if wide else step.astype(np.float32)[:, None]
        return levels[:n].astype(np.float32)
