"""m-bit packing of uint64 values, so a masked input costs m bits per element on the wire
(not 64). Vectorized by phase: elements a fixed distance apart share a bit alignment."""

from __future__ import annotations

import math

import numpy as np


def packed_size(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


def pack(values: np.ndarray, bits: int) -> bytes:
    """``values`` (each < 2**bits) as a little-endian bit stream, ``packed_size`` bytes."""
    count = values.size
    period = 64 // math.gcd(bits, 64)  # elements until the bit offset is word-aligned again
    words = period * bits // 64
    chunks = -(-count // period)
    padded = np.zeros(chunks * period, dtype=np.uint64)
    padded[:count] = values
    grid = padded.reshape(chunks, period)
    out = np.zeros((chunks, words), dtype="<u8")
    for p in range(period):
        start = p * bits
        w, off = start >> 6, start & 63
        out[:, w] |= grid[:, p] << np.uint64(off)
        if off + bits > 64:
            out[:, w + 1] |= grid[:, p] >> np.uint64(64 - off)
    return out.tobytes()[: packed_size(count, bits)]


def unpack(data: bytes | memoryview, count: int, bits: int) -> np.ndarray:
    """The inverse of :func:`pack`; ``data`` must be exactly ``packed_size`` bytes."""
    if len(data) != packed_size(count, bits):
        raise ValueError("packed data has the wrong length")
    mask = np.uint64((1 << bits) - 1)
    if bits <= 56:
        return _unpack_bytewise(data, count, bits, mask)
    period = 64 // math.gcd(bits, 64)
    words = period * bits // 64
    chunks = -(-count // period)
    buf = bytearray(chunks * words * 8)
    buf[: len(data)] = data
    grid = np.frombuffer(buf, dtype="<u8").reshape(chunks, words)
    out = np.empty((chunks, period), dtype=np.uint64)
    for p in range(period):
        start = p * bits
        w, off = start >> 6, start & 63
        x = grid[:, w] >> np.uint64(off)
        if off + bits > 64:
            x |= grid[:, w + 1] << np.uint64(64 - off)
        out[:, p] = x & mask
    return out.reshape(-1)[:count]


def _unpack_bytewise(
    data: bytes | memoryview, count: int, bits: int, mask: np.uint64
) -> np.ndarray:
    """For m <= 56 every value lies inside one unaligned 8-byte read: one strided view per
    byte phase (at most 8), no per-word loop."""
    period = 8 // math.gcd(bits, 8)  # elements until the offset is byte-aligned again
    stride = period * bits // 8
    buf = bytearray(len(data) + 8)
    buf[: len(data)] = data
    out = np.empty(count, dtype=np.uint64)
    for p in range(min(period, count)):
        start = p * bits
        n = len(range(p, count, period))
        view = np.ndarray((n,), dtype="<u8", buffer=buf, offset=start >> 3, strides=(stride,))
        out[p::period] = (view >> np.uint64(start & 7)) & mask
    return out
