"""Byte ranges of the device protocol: ``Range`` on model downloads, ``Content-Range`` on
upload chunks, and the set of ranges an upload has received (what a device resumes from).

Pure functions over strings and integers; every range here is half-open ``[start, end)``
inside, and inclusive ``START-END`` on the wire, as HTTP writes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from flotilla.core.errors import WireError

_RANGE = re.compile(r"bytes=(\d{1,19})?-(\d{1,19})?")
_CONTENT_RANGE = re.compile(r"bytes (\d{1,19})-(\d{1,19})/(\d{1,19})")


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """The one range a ``Range`` header asks of a blob of ``size`` bytes, half-open.

    ``bytes=A-B``, ``bytes=A-`` and ``bytes=-N`` (the last N bytes). None: a range that
    covers nothing the blob has (answer 416). WireError: not a single byte range.
    """
    match = _RANGE.fullmatch(header.strip())
    if match is None or (match.group(1) is None and match.group(2) is None):
        raise WireError(
            f"Range must be one byte range 'bytes=START-END', 'bytes=START-' or "
            f"'bytes=-LAST', got {header[:80]!r}"
        )
    first, last = match.group(1), match.group(2)
    if first is None:
        suffix = int(last)
        return (max(0, size - suffix), size) if suffix > 0 and size > 0 else None
    start = int(first)
    end = size if last is None else min(int(last) + 1, size)
    if start >= size or (last is not None and int(last) < start):
        return None
    return start, end


def parse_content_range(header: str, size: int) -> tuple[int, int]:
    """``bytes A-B/TOTAL`` of an upload chunk, half-open; TOTAL must be the declared size."""
    match = _CONTENT_RANGE.fullmatch(header.strip())
    if match is None:
        raise WireError(
            f"Content-Range must be 'bytes START-END/TOTAL' (END inclusive), got {header[:80]!r}"
        )
    start, last, total = (int(g) for g in match.groups())
    if total != size:
        raise WireError(f"Content-Range total {total} is not the upload's declared size {size}")
    if last < start or last >= size:
        raise WireError(f"Content-Range bytes {start}-{last} lie outside 0-{size - 1}")
    return start, last + 1


@dataclass(slots=True)
class ByteRanges:
    """Disjoint, sorted, merged half-open ranges: the bytes an upload holds so far."""

    spans: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(end - start for start, end in self.spans)

    def add(self, start: int, end: int) -> None:
        merged: list[tuple[int, int]] = []
        for s, e in sorted([*self.spans, (start, end)]):
            if merged and s <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((s, e))
        self.spans = merged

    def overlaps(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` already held."""
        return [(max(s, start), min(e, end)) for s, e in self.spans if s < end and e > start]

    def missing(self, size: int) -> list[tuple[int, int]]:
        """The gaps in ``[0, size)``."""
        gaps, at = [], 0
        for s, e in self.spans:
            if s > at:
                gaps.append((at, s))
            at = max(at, e)
        if at < size:
            gaps.append((at, size))
        return gaps


def inclusive(spans: list[tuple[int, int]]) -> list[list[int]]:
    """Half-open spans as the wire writes them: ``[[first, last], ...]``, both inclusive."""
    return [[s, e - 1] for s, e in spans]
