"""Blobs on the wire: split into chunks under the message limit, checked by SHA-256."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np

from flotilla.core.errors import IntegrityError, WireError

#: Chunk size for streaming blobs: well under gRPC's message limit.
CHUNK_BYTES = 1024 * 1024


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def iter_chunks(
    data: bytes | bytearray | memoryview, size: int = CHUNK_BYTES
) -> Iterator[memoryview]:
    view = memoryview(data)
    for start in range(0, len(view), size):
        yield view[start : start + size]


class BlobAssembler:
    """Collects the chunks of one blob into a buffer of its declared size, then verifies it.

    The declared size is checked against ``max_bytes`` before anything is allocated, and
    every chunk is bounds-checked, so a lying sender cannot make us grow without limit.
    """

    def __init__(self, expected_size: int, expected_sha256: str, max_bytes: int) -> None:
        if expected_size < 0 or expected_size > max_bytes:
            raise WireError(f"blob of {expected_size} bytes exceeds the limit of {max_bytes}")
        if len(expected_sha256) != 64:
            raise WireError("blob sha256 must be 64 hex characters")
        self.expected_size = expected_size
        self.expected_sha256 = expected_sha256
        # Uninitialised: every byte is written before finish() hands the buffer out, and
        # zero-filling a model-sized buffer per transfer is measurable CPU on a busy server.
        self._buf = np.empty(expected_size, dtype=np.uint8)
        self._pos = 0
        self._hash = hashlib.sha256()

    @property
    def received(self) -> int:
        return self._pos

    def add(self, chunk: bytes | memoryview, offset: int | None = None) -> None:
        if offset is not None and offset != self._pos:
            raise WireError(f"chunk at offset {offset}, expected {self._pos}")
        end = self._pos + len(chunk)
        if end > self.expected_size:
            raise WireError(f"blob longer than its declared {self.expected_size} bytes")
        self._buf[self._pos : end] = np.frombuffer(chunk, dtype=np.uint8)
        self._hash.update(chunk)
        self._pos = end

    def finish(self) -> memoryview:
        """The verified blob, without a copy."""
        if self._pos != self.expected_size:
            raise WireError(f"blob truncated: {self._pos} of {self.expected_size} bytes")
        if self._hash.hexdigest() != self.expected_sha256:
            raise IntegrityError("blob sha256 does not match its declared digest")
        return self._buf.data.cast("B")
