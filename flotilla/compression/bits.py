"""Bit-level helpers the codecs share: bfloat16 rounding, bit packing, seeded index sampling.

Pure numpy functions with no state, so the encoder on a device and the decoder on the
server run the same arithmetic and agree bit for bit.
"""

from __future__ import annotations

import numpy as np

_U64 = np.uint64
_MASK64 = (1 << 64) - 1
#: Most cycle-walking steps before we call the sampler broken (expected: under 2).
_MAX_WALK = 4096


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round finite float32 to bfloat16 bits, to nearest even, saturating at the bf16 max.

    Saturation keeps finite inputs finite: float32 values above 3.3895e38 would otherwise
    round up to infinity.
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + (((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF))
    out: np.ndarray = (rounded >> np.uint32(16)).astype(np.uint16)
    overflow = (out & np.uint16(0x7FFF)) == np.uint16(0x7F80)
    if overflow.any():
        out[overflow] -= np.uint16(1)  # +-inf -> +-max finite
    return out


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) back to float32: exact, the low 16 mantissa bits are zero."""
    out: np.ndarray = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return out


def pack_nibbles(u: np.ndarray) -> np.ndarray:
    """Pack values 0..15 two per byte, first value in the low nibble; odd counts pad with 8."""
    n = u.size
    if n % 2:
        u = np.concatenate([u, np.full(1, 8, np.uint8)])
    out: np.ndarray = (u[0::2] | (u[1::2] << np.uint8(4))).astype(np.uint8, copy=False)
    return out


def unpack_nibbles(packed: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` nibbles of ``packed``, low nibble first, as uint8."""
    out = np.empty(packed.size * 2, np.uint8)
    out[0::2] = packed & np.uint8(0x0F)
    out[1::2] = packed >> np.uint8(4)
    return out[:n]


def packed_size(n: int, bits: int) -> int:
    """Bytes that ``pack_codes`` writes for ``n`` codes of ``bits`` bits (groups of eight)."""
    return -(-n // 8) * bits


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack ``bits``-bit codes (1..8) tightly: every 8 codes become ``bits`` bytes."""
    n = codes.size
    groups = -(-n // 8)
    if bits in (4, 8):  # byte-aligned: the same layout, without 64-bit lanes
        lanes8 = np.zeros(groups * 8, np.uint8)
        lanes8[:n] = codes
        return lanes8 if bits == 8 else pack_nibbles(lanes8)
    padded = np.zeros(groups * 8, _U64)
    padded[:n] = codes
    lanes = padded.reshape(groups, 8)
    word = lanes[:, 0].copy()
    for j in range(1, 8):
        word |= lanes[:, j] << _U64(bits * j)
    raw = word.astype("<u8").view(np.uint8).reshape(groups, 8)
    return np.ascontiguousarray(raw[:, :bits]).reshape(-1)


def unpack_codes(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """The first ``n`` codes of ``pack_codes`` output, as uint8."""
    groups = packed.size // bits
    if bits == 8:
        return packed[:n]
    if bits == 4:
        return unpack_nibbles(packed, n)
    raw = np.zeros((groups, 8), np.uint8)
    raw[:, :bits] = packed.reshape(groups, bits)
    word = raw.view("<u8").reshape(groups, 1)
    shifts = (np.arange(8, dtype=_U64) * _U64(bits)).reshape(1, 8)
    codes: np.ndarray = ((word >> shifts) & _U64((1 << bits) - 1)).astype(np.uint8)
    return codes.reshape(-1)[:n]


def _splitmix(z: np.ndarray) -> np.ndarray:
    """The SplitMix64 finaliser: a fixed, version-independent 64-bit mixer."""
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    out: np.ndarray = z ^ (z >> _U64(31))
    return out


def _round_keys(seed: int, rounds: int = 4) -> list[np.uint64]:
    keys = []
    state = seed & _MASK64
    for _ in range(rounds):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        keys.append(_U64(z ^ (z >> 31)))
    return keys


def sample_indices(seed: int, n: int, k: int) -> np.ndarray:
    """``k`` distinct indices in ``[0, n)`` derived only from ``seed``, in O(k) time.

    A 4-round Feistel permutation of a power-of-four domain, cycle-walked into ``[0, n)``,
    applied to ``0..k-1``. We avoid ``Generator.choice``: numpy does not promise the same
    draws across versions, and device and server may run different ones.
    """
    if k <= 0:
        return np.zeros(0, np.int64)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = _U64((1 << half) - 1)
    keys = _round_keys(seed)

    def permute(v: np.ndarray) -> np.ndarray:
        left, right = v >> _U64(half), v & mask
        for key in keys:
            left, right = right, left ^ (_splitmix(right ^ key) & mask)
        out: np.ndarray = (left << _U64(half)) | right
        return out

    with np.errstate(over="ignore"):
        out = permute(np.arange(k, dtype=_U64))
        pending = np.flatnonzero(out >= _U64(n))
        for _ in range(_MAX_WALK):
            if pending.size == 0:
                return out.astype(np.int64)
            out[pending] = permute(out[pending])
            pending = pending[out[pending] >= _U64(n)]
    raise RuntimeError("index sampler did not converge")  # unreachable for a bijection
