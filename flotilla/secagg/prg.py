"""Mask expansion: a 32-byte seed -> uint64 integers mod 2**m, ChaCha20 keystream at full
key length (no numpy generator, no folding of the key into a small seed).

Masks are added mod 2**64 and the sum reduced mod 2**m once at the end: 2**m divides 2**64,
so the result is the same as reducing every mask, one pass cheaper per seed."""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

SEED_BYTES = 32
#: ChaCha20's 16-byte nonce (counter and nonce); a seed is used for one expansion only.
_NONCE = bytes(16)


class Expander:
    """Expands seeds into masks of one length, reusing its buffers (the server expands many
    seeds per round; each expansion is one ``update_into`` of zeros into the keystream)."""

    def __init__(self, words: int, modulus_bits: int) -> None:
        self.words = words
        self._zeros = bytes(8 * words)
        self._out = bytearray(8 * words)
        self._mask = np.uint64((1 << modulus_bits) - 1)

    def expand(self, seed: bytes) -> np.ndarray:
        """The raw keystream as uint64 (not yet reduced mod 2**m): a view of the shared
        buffer, to use before the next call (or copy)."""
        if len(seed) != SEED_BYTES:
            raise ValueError("a mask seed is 32 bytes")
        encryptor = Cipher(algorithms.ChaCha20(seed, _NONCE), mode=None).encryptor()
        encryptor.update_into(self._zeros, self._out)
        return np.frombuffer(self._out, dtype="<u8")

    def reduce(self, values: np.ndarray) -> np.ndarray:
        """``values`` mod 2**m, in place."""
        np.bitwise_and(values, self._mask, out=values)
        return values

    def add(self, acc: np.ndarray, seed: bytes, sign: int) -> None:
        """acc +-= PRG(seed) mod 2**64 (callers :meth:`reduce` mod 2**m at the end)."""
        mask = self.expand(seed)
        if sign > 0:
            np.add(acc, mask, out=acc)
        else:
            np.subtract(acc, mask, out=acc)


def expand(seed: bytes, words: int, modulus_bits: int) -> np.ndarray:
    """PRG(seed) as ``words`` integers in [0, 2**modulus_bits)."""
    expander = Expander(words, modulus_bits)
    out: np.ndarray = expander.reduce(expander.expand(seed).copy())
    return out
