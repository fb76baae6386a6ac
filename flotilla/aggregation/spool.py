"""A round's updates on disk, for rules that need all of them at once (median, Krum, ...).

Each update becomes one row of float32s in a file; finalize reads column blocks of every
row through ``np.memmap``, so RAM holds ``block x n`` values, never ``n x model``. Each row
segment gets its own short-lived map: mapped file pages count as RSS until unmapped.

Rows are appended with ``os.pwrite`` rather than through a writable map: a full disk then
raises ``ENOSPC`` (the update is refused and the row rolled back) instead of ``SIGBUS``.

Each spool file holds an exclusive ``flock`` while its aggregator lives. Constructing a
spool removes every unlocked spool file in the directory -- leftovers of a crashed server --
so several jobs may share a directory safely.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import uuid
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flotilla.aggregation._kernels import blocks, flat, numel
from flotilla.aggregation.base import require
from flotilla.core.errors import SpecError, UpdateRejected
from flotilla.core.tensors import TensorSpec

SUFFIX = ".flspool"
GiB = 1 << 30
#: Bytes per ``pwrite``: below Linux's 2 GiB cap on one write.
_WRITE_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class SpoolLimits:
    """Server-side bounds on one round's spool (not part of a job's params)."""

    #: Most updates one round may hold.
    max_updates: int = 1000
    #: Most bytes one round's spool file may reach (rows are float32).
    max_bytes: int = 64 * GiB
    #: Free disk space that must remain after appending a row.
    reserve_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        require(self.max_updates >= 1, "max_updates", "an integer >= 1", self.max_updates)
        require(self.max_bytes >= 1, "max_bytes", "an integer >= 1", self.max_bytes)
        require(self.reserve_bytes >= 0, "reserve_bytes", ">= 0", self.reserve_bytes)


def sweep(directory: Path) -> list[Path]:
    """Remove spool files no live aggregator holds (their lock is free); returns them."""
    removed = []
    for path in directory.glob(f"*{SUFFIX}"):
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
        os.close(fd)
    return removed


def _discard(path: Path, fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    with contextlib.suppress(OSError):
        os.close(fd)


class UpdateSpool:
    """One round's updates as rows of a float32 file, read back in column blocks."""

    def __init__(
        self, directory: Path, layout: tuple[TensorSpec, ...], limits: SpoolLimits | None = None
    ) -> None:
        self.directory = Path(directory)
        self.layout = layout
        self.limits = limits or SpoolLimits()
        self.row_elems = sum(numel(s) for s in layout)
        self.row_bytes = 4 * self.row_elems
        self.capacity = min(self.limits.max_updates, self.limits.max_bytes // self.row_bytes)
        if self.capacity < 1:
            raise SpecError(
                f"max_bytes={self.limits.max_bytes} cannot hold one update of "
                f"{self.row_bytes} bytes"
            )
        self.directory.mkdir(parents=True, exist_ok=True)
        sweep(self.directory)
        self.count = 0
        self.path: Path | None = None
        self._fd = -1
        self._cleanup: weakref.finalize[[Path, int], UpdateSpool] | None = None

    def open(self, round: int) -> None:
        """Start an empty spool file for ``round`` (dropping any previous one)."""
        self.close()
        while True:
            path = self.directory / f"r{round}-{uuid.uuid4().hex}{SUFFIX}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            # Another server's sweep may have unlinked it before we held the lock.
            if path.exists() and os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)
        self.path, self._fd, self.count = path, fd, 0
        self._cleanup = weakref.finalize(self, _discard, path, fd)

    def append(self, update: Mapping[str, np.ndarray]) -> None:
        """Write one validated update as the next row; UpdateRejected leaves no trace."""
        if self._fd < 0:
            raise RuntimeError("the spool is not open")
        if self.count >= self.capacity:
            raise UpdateRejected(
                f"the round's spool is full: {self.count} updates of {self.row_bytes} bytes "
                f"(max_updates={self.limits.max_updates}, max_bytes={self.limits.max_bytes})"
            )
        free = shutil.disk_usage(self.directory).free
        if free < self.row_bytes + self.limits.reserve_bytes:
            raise UpdateRejected(
                f"spool disk {self.directory} has {free} bytes free; an update needs "
                f"{self.row_bytes} plus a reserve of {self.limits.reserve_bytes}"
            )
        start = self.count * self.row_bytes
        try:
            self._write_row(update, start)
        except OSError as exc:
            os.ftruncate(self._fd, start)
            raise UpdateRejected(f"could not spool the update: {exc}") from exc
        self.count += 1

    def _write_row(self, update: Mapping[str, np.ndarray], offset: int) -> None:
        tmp = np.empty(0, dtype=np.float32)
        for spec in self.layout:
            arr = flat(update[spec.name])
            if arr.dtype == np.float32 and arr.flags.c_contiguous:
                raw = arr.data.cast("B")
                for sl in blocks(len(raw), _WRITE_BYTES):
                    offset = self._pwrite(raw[sl], offset)
                continue
            if tmp.size == 0:
                tmp = np.empty(_WRITE_BYTES // 4, dtype=np.float32)
            for sl in blocks(arr.size, tmp.size):
                part = tmp[: sl.stop - sl.start]
                np.copyto(part, arr[sl], casting="unsafe")
                offset = self._pwrite(part.data.cast("B"), offset)

    def _pwrite(self, data: memoryview, offset: int) -> int:
        while len(data):
            written = os.pwrite(self._fd, data, offset)
            data, offset = data[written:], offset + written
        return offset

    def columns(self, start: int, stop: int, rows: Sequence[int] | None = None) -> np.ndarray:
        """Elements ``[start, stop)`` of every row (or of ``rows``), copied into RAM.

        One small map per row segment, unmapped at once: a map over the whole file would
        let the kernel map whole large folios around each fault (up to 2 MiB per row), so
        the resident set would briefly reach ``rows x 2 MiB``.
        """
        if self.path is None or self.count == 0:
            raise RuntimeError("the spool holds no updates")
        picked = range(self.count) if rows is None else rows
        out = np.empty((len(picked), stop - start), dtype=np.float32)
        with open(self.path, "rb") as fh:
            for k, i in enumerate(picked):
                if not 0 <= i < self.count:
                    raise IndexError(f"row {i} of {self.count}")
                offset = i * self.row_bytes + 4 * start
                seg = np.memmap(fh, dtype=np.float32, mode="r", offset=offset, shape=out.shape[1:])
                out[k] = seg
                del seg
        return out

    def close(self) -> None:
        """Remove the file; safe to call twice, and run at garbage collection too."""
        if self._cleanup is not None:
            self._cleanup()
        self._cleanup, self.path, self._fd, self.count = None, None, -1, 0
