"""Model checkpoints on disk, addressed by their SHA-256, written atomically."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import socket
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from flotilla.core.blobs import CHUNK_BYTES, sha256_hex
from flotilla.core.errors import IntegrityError, NotFoundError, StorageUnavailable
from flotilla.core.lifetime import gone_here

#: A write that failed for want of space: nothing is wrong with the blob, retry later.
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


#: A write in progress: ``.tmp-PID@HOST~RANDOM``, renamed into place when whole.
_TMP = ".tmp-"
#: A temporary file nobody touched for this long is a write its writer abandoned, whoever
#: that was (another machine's, or one named the old way).
ABANDONED_WRITE_AGE_S = 24 * 3600.0


def _abandoned(path: Path, now: float) -> bool:
    """A write a crash cut short: its writer, a process of this machine, is gone, or it
    has not been touched for :data:`ABANDONED_WRITE_AGE_S`."""
    pid_text, at, rest = path.name.removeprefix(_TMP).partition("@")
    host = rest.rpartition("~")[0]
    if at and pid_text.isdigit() and gone_here(host, int(pid_text)):
        return True
    try:
        return now - path.stat().st_mtime > ABANDONED_WRITE_AGE_S
    except FileNotFoundError:
        return False


def _unavailable(exc: OSError) -> StorageUnavailable:
    return StorageUnavailable(f"disk full: {exc.strerror} ({exc.filename or 'blob store'})")


class BlobStore:
    """``root/ab/abcdef...``: a blob's name is its digest, so a write is idempotent.

    Files are fsynced and renamed into place, so a crash leaves either the whole blob or
    nothing under its name; a database row may point at a blob only after this returns.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        #: Blobs this process wrote or already hashed: immutable, so not hashed again on
        #: every round that maps them.
        self._verified: set[str] = set()
        #: Temporary files are named after their writer: servers sharing the directory
        #: must not remove each other's writes in progress.
        self._prefix = f"{_TMP}{os.getpid()}@{socket.gethostname()}~"
        now = time.time()
        for leftover in self.root.glob(f"**/{_TMP}*"):
            if _abandoned(leftover, now):
                leftover.unlink(missing_ok=True)

    def path(self, sha256: str) -> Path:
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise NotFoundError(f"not a sha256 digest: {sha256!r}")
        return self.root / sha256[:2] / sha256

    def put(self, data: bytes | bytearray | memoryview) -> str:
        return self.put_parts([data])

    def put_parts(self, parts: Iterable[bytes | bytearray | memoryview]) -> str:
        """Write a blob given as consecutive pieces, hashing as it goes.

        A checkpoint is written straight from the model's arrays, never joined into one
        model-sized buffer first.
        """
        digest = hashlib.sha256()
        try:
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=self._prefix)
        except OSError as exc:
            if exc.errno in _DISK_FULL:
                raise _unavailable(exc) from exc
            raise
        try:
            with os.fdopen(fd, "wb") as fh:
                for part in parts:
                    digest.update(part)
                    fh.write(part)
                fh.flush()
                os.fsync(fh.fileno())
            sha = digest.hexdigest()
            target = self.path(sha)
            if target.exists() and self._intact(target, sha):
                Path(tmp).unlink()
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, target)
        except OSError as exc:
            Path(tmp).unlink(missing_ok=True)
            if exc.errno in _DISK_FULL:
                raise _unavailable(exc) from exc
            raise
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._verified.add(sha)
        return sha

    @staticmethod
    def _intact(path: Path, sha256: str) -> bool:
        """A copy already on disk counts only if it still hashes to its name."""
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            while chunk := fh.read(CHUNK_BYTES):
                digest.update(chunk)
        return digest.hexdigest() == sha256

    def get(self, sha256: str) -> bytes:
        try:
            data = self.path(sha256).read_bytes()
        except FileNotFoundError as exc:
            raise NotFoundError(f"no blob {sha256}") from exc
        if sha256_hex(data) != sha256:
            raise IntegrityError(f"blob {sha256} is corrupt on disk")
        return data

    def get_mapped(self, sha256: str) -> memoryview:
        """A verified blob as a read-only memory map: pages load only when read.

        A round holds its global model for its whole length but reads it only to finalize;
        mapped, it costs memory only then. Blobs are never rewritten in place, so the map
        cannot change under the reader, and one check per process is enough.
        """
        path = self.path(sha256)
        if sha256 not in self._verified:
            try:
                intact = self._intact(path, sha256)
            except FileNotFoundError as exc:
                raise NotFoundError(f"no blob {sha256}") from exc
            if not intact:
                raise IntegrityError(f"blob {sha256} is corrupt on disk")
            self._verified.add(sha256)
        with path.open("rb") as fh:
            if os.fstat(fh.fileno()).st_size == 0:
                return memoryview(b"")
            return memoryview(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))

    def size(self, sha256: str) -> int:
        try:
            return self.path(sha256).stat().st_size
        except FileNotFoundError as exc:
            raise NotFoundError(f"no blob {sha256}") from exc

    def iter_chunks(self, sha256: str, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """Stream a blob from disk without holding it in memory."""
        try:
            fh = self.path(sha256).open("rb")
        except FileNotFoundError as exc:
            raise NotFoundError(f"no blob {sha256}") from exc
        with fh:
            while chunk := fh.read(chunk_bytes):
                yield chunk
