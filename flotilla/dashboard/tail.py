"""Following files another process is still writing: a JSON Lines file read in increments
(complete lines only) and a whole JSON file read again when it changes.

``flotilla dashboard DIR`` watches a running ``flotilla simulate`` through these: the
writer appends and flushes whole rows, but a read can still land mid-row, before the file
exists, or after a new run truncated it.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Bytes of a file's start remembered to notice it was rewritten by a new run.
_HEAD_BYTES = 256


@dataclass(frozen=True, slots=True)
class Tailed:
    """What one read of a tailed file found."""

    #: The file was truncated, replaced or removed since the last read: start over.
    reset: bool
    #: Rows appended since the last read (after a reset: from the file's start).
    rows: tuple[dict[str, Any], ...]


class JsonlTail:
    """Reads a JSON Lines file in increments, remembering how far it got.

    A last line without its newline is left for the next read; a line that is not a JSON
    object is skipped (and logged once per read). Not thread-safe: one reader at a time.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._head = b""

    def restart(self) -> None:
        """Read the file from its start next time."""
        self._offset, self._head = 0, b""

    def read(self) -> Tailed:
        try:
            with self.path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                reset = self._rewritten(f, size)
                if size == self._offset:
                    return Tailed(reset, ())
                f.seek(self._offset)
                data = f.read(size - self._offset)
        except FileNotFoundError:
            reset = self._offset > 0
            self._offset, self._head = 0, b""
            return Tailed(reset, ())
        end = data.rfind(b"\n")
        if end < 0:
            return Tailed(reset, ())  # only part of a line so far
        if self._offset == 0:
            self._head = data[:_HEAD_BYTES]
        self._offset += end + 1
        return Tailed(reset, _parse(data[: end + 1], self.path))

    def _rewritten(self, f: Any, size: int) -> bool:
        """Whether the file is no longer the one read so far (then read it from 0)."""
        if self._offset == 0:
            return False
        if size >= self._offset:
            f.seek(0)
            if f.read(len(self._head)) == self._head:
                return False
        self._offset, self._head = 0, b""
        return True


def _parse(data: bytes, path: Path) -> tuple[dict[str, Any], ...]:
    rows: list[dict[str, Any]] = []
    bad = 0
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    if bad:
        log.warning("%s: skipped %d line(s) that are not JSON objects", path, bad)
    return tuple(rows)


class JsonFile:
    """A JSON file written whole (rename or rewrite): read again only when its size or
    modification time changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int] | None = None

    def restart(self) -> None:
        """Read the file next time, changed or not."""
        self._seen = None

    def read(self) -> tuple[bool, dict[str, Any] | None]:
        """(changed, content): content is None while the file is missing or unreadable
        (a half-written file is read again at the next call)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            changed = self._seen is not None
            self._seen = None
            return changed, None
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._seen:
            return False, None
        try:
            content = json.loads(self.path.read_bytes())
        except (OSError, ValueError):
            return False, None
        if not isinstance(content, dict):
            return False, None
        self._seen = stamp
        return True, content
