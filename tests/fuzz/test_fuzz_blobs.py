"""Chunk streams reassembled into a blob: a stream of ``BlobChunk`` messages read with the
bulk framing, as the agent (size and digest from its work order) and the operator's export
(size and digest from the first chunk) put them together."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from flotilla.core.blobs import BlobAssembler, iter_chunks
from flotilla.core.errors import WireError
from flotilla.proto.bulk import blob_chunk, read_blob_chunk
from tests.fuzz.harness import Target, fuzz, mutate, mutated, recipes

pytestmark = [pytest.mark.fuzz, pytest.mark.xdist_group("fuzz"), pytest.mark.timeout(300)]

_BLOB = bytes(range(256)) * 4
_SHA = hashlib.sha256(_BLOB).hexdigest()
#: Most messages one input's stream holds: a few past the longest seed's.
MAX_MESSAGES = 12
#: The receiver's limit: well above the blob, far below the memory bound.
MAX_BYTES = 1 << 20


def stream(messages: list[bytes]) -> bytes:
    """The harness's framing of a stream: each message behind its u32 length."""
    return b"".join(struct.pack("<I", len(m)) + m for m in messages)


def messages(data: bytes) -> list[bytes]:
    """The inverse of :func:`stream`; a length past the end takes what is left."""
    out, pos = [], 0
    while pos + 4 <= len(data) and len(out) < MAX_MESSAGES:
        (n,) = struct.unpack_from("<I", data, pos)
        out.append(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return out


def _chunks(size: int) -> list[bytes]:
    return [
        blob_chunk(piece, i * size, len(_BLOB), _SHA)
        for i, piece in enumerate(iter_chunks(_BLOB, size))
    ]


SEEDS = (stream(_chunks(256)), stream(_chunks(300)), stream(_chunks(1024)))


def reassemble(data: bytes) -> None:
    pieces = [read_blob_chunk(m) for m in messages(data)]
    try:  # the agent: size and digest from its work order, offsets implied
        agent = BlobAssembler(len(_BLOB), _SHA, MAX_BYTES)
        for piece in pieces:
            agent.add(piece.data)
        agent.finish()
    except WireError:
        pass
    export: BlobAssembler | None = None  # the export: size and digest from the first chunk
    for piece in pieces:
        if export is None:
            export = BlobAssembler(piece.total_size, piece.sha256, MAX_BYTES)
        export.add(piece.data, piece.offset)
    if export is not None:
        export.finish()


def _reorder(message: bytes, rng: random.Random) -> bytes:
    """Chunks of a valid stream dropped, repeated or swapped, then maybe mutated."""
    parts = messages(message)
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(parts))
        what = rng.randrange(3)
        if what == 0 and len(parts) > 1:
            del parts[i]
        elif what == 1:
            parts.insert(i, parts[rng.randrange(len(parts))])
        else:
            j = rng.randrange(len(parts))
            parts[i], parts[j] = parts[j], parts[i]
    out = stream(parts)
    return mutate(out, rng) if rng.random() < 0.3 else out


TARGET = Target("blobs", reassemble, (WireError,))


def test_chunk_streams_reassemble_or_raise_our_errors() -> None:
    fuzz(TARGET, mutated(SEEDS) | recipes(SEEDS, _reorder), regressions=SEEDS)
