"""The device edge's byte-range headers: ``Range`` on model downloads, ``Content-Range``
on upload chunks, and the received-ranges set each accepted chunk grows."""

from __future__ import annotations

import random
import struct

import pytest

from flotilla.core.errors import WireError
from flotilla.server.http.byteranges import ByteRanges, parse_content_range, parse_range
from tests.fuzz.harness import INTERESTING, Target, fuzz, mutate, recipes

pytestmark = [pytest.mark.fuzz, pytest.mark.xdist_group("fuzz"), pytest.mark.timeout(300)]

#: The input's first 8 bytes are the blob's or upload's size; the rest is the header value.
SEEDS = tuple(
    struct.pack("<Q", size) + header
    for size, header in (
        (4096, b"bytes=0-1023"),
        (4096, b"bytes=1024-"),
        (4096, b"bytes=-100"),
        (4096, b"bytes 0-1023/4096"),
        (10, b"bytes 9-9/10"),
        (0, b"bytes=0-0"),
    )
)
_NUMBERS = tuple(str(n).encode() for n in (*INTERESTING, 10**19 - 1, 10**19))


def _numbers(message: bytes, rng: random.Random) -> bytes:
    """A seed with its numbers swapped for edge values (sizes included)."""
    size = struct.pack("<Q", rng.choice(INTERESTING) % 2**64) if rng.random() < 0.5 else b""
    head = bytearray(message[8:])
    out = bytes(head)
    for digit_run in sorted({c for c in range(len(head)) if chr(head[c]).isdigit()})[:3]:
        if rng.random() < 0.5:
            out = out[:digit_run] + rng.choice(_NUMBERS) + out[digit_run + 1 :]
    data = (size or message[:8]) + out
    return mutate(data, rng) if rng.random() < 0.2 else data


def parse(data: bytes) -> None:
    size = struct.unpack("<Q", data[:8].ljust(8, b"\0"))[0] % 2**63
    header = data[8:].decode("latin-1")  # how aiohttp hands a header's bytes over
    held = ByteRanges()
    refused: WireError | None = None
    try:
        found = parse_range(header, size)
        if found is not None:
            assert 0 <= found[0] < found[1] <= size, f"range {found} outside {size}"
    except WireError as exc:
        refused = exc
    try:
        start, end = parse_content_range(header, size)
        assert 0 <= start < end <= size, f"content range {start}-{end} outside {size}"
        held.add(start, end)
        held.overlaps(start, end)
        held.missing(size)
    except WireError:
        if refused is not None:
            raise


TARGET = Target("byteranges", parse, (WireError,))


def test_range_headers_parse_or_raise_our_errors() -> None:
    inputs = recipes(SEEDS, lambda m, rng: mutate(m, rng)) | recipes(SEEDS, _numbers)
    fuzz(TARGET, inputs, regressions=SEEDS)
