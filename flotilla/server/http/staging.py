"""Partial uploads of HTTP devices, staged on disk until they are whole.

A phone on a flaky link may take minutes to send its update, in chunks, in any order,
again after a broken connection. Held in memory, each would pin a model-sized buffer
outside the upload budget for all that time; on disk (a sparse file of the declared size
under the server's state dir) it costs page cache only. The budget is taken when the
whole update goes to the core (``Federation.submit_update`` assembles it in memory).

Bounds: each file is at most its declared size (checked against the round's limit before
it exists), a device stages one upload at a time, all staged bytes together at most
``max_bytes``; an upload expires with its round (deadline plus grace). A finished upload
leaves a tombstone until then, so a replay is answered for what it is.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import shutil
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from flotilla.core.blobs import CHUNK_BYTES
from flotilla.core.errors import ConflictError, NotFoundError, StaleRoundError, Unreachable
from flotilla.core.lifetime import gone_here
from flotilla.core.work import Reservation, UploadHeader
from flotilla.server.http.byteranges import ByteRanges

#: ``open``: taking chunks; ``finalizing``: whole, with the core; then ``accepted`` or
#: ``refused`` (a tombstone: the file is gone).
STATES = ("open", "finalizing", "accepted", "refused")


@dataclass(slots=True)
class StagedUpload:
    id: str
    device_id: str
    header: UploadHeader
    path: Path
    #: ``clock()`` time after which the upload is dropped (its round is over).
    expires_at: float
    reservation: Reservation | None
    reserved_at: float
    received: ByteRanges = field(default_factory=ByteRanges)
    state: str = "open"
    detail: str = ""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def size(self) -> int:
        return self.header.payload_size


class UploadStaging:
    """The staged uploads of one server process, in its own directory under ``parent``
    (``PID@HOST``): servers of a deployment share a state directory, and one that starts
    or stops must not remove another's uploads in progress."""

    def __init__(self, parent: Path, max_bytes: int, clock: Callable[[], float]) -> None:
        self._parent = parent
        self._root = parent / f"{os.getpid()}@{socket.gethostname()}"
        self._max_bytes = max_bytes
        self._clock = clock
        self._uploads: dict[str, StagedUpload] = {}

    def open(self) -> None:
        """Empty this process's directory, and remove those of processes of this machine
        that are gone (their rounds are over)."""
        self._parent.mkdir(parents=True, exist_ok=True)
        for other in self._parent.iterdir():
            pid_text, _, host = other.name.partition("@")
            if other == self._root or (pid_text.isdigit() and gone_here(host, int(pid_text))):
                shutil.rmtree(other, ignore_errors=True)
        self._root.mkdir(exist_ok=True)

    def close(self) -> None:
        self._uploads.clear()
        shutil.rmtree(self._root, ignore_errors=True)

    @property
    def staged_bytes(self) -> int:
        return sum(u.size for u in self._uploads.values() if u.state in ("open", "finalizing"))

    def create(
        self,
        device_id: str,
        header: UploadHeader,
        expires_at: float,
        reservation: Reservation,
    ) -> StagedUpload:
        """A new staged upload; the device's earlier open one is dropped."""
        self.sweep()
        for old in [u for u in self._uploads.values() if u.device_id == device_id]:
            if old.state == "open":
                self.finish(old, "refused", "replaced by a newer upload of the same device")
        if self.staged_bytes + header.payload_size > self._max_bytes:
            raise Unreachable("the server is staging too many uploads; try again shortly")
        upload_id = "up-" + secrets.token_hex(16)
        path = self._root / f"{upload_id}.part"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.ftruncate(fd, header.payload_size)  # sparse: disk is used as bytes arrive
        finally:
            os.close(fd)
        now = self._clock()
        upload = StagedUpload(upload_id, device_id, header, path, expires_at, reservation, now)
        self._uploads[upload_id] = upload
        return upload

    def get(self, upload_id: str, device_id: str) -> StagedUpload:
        """The device's upload; NotFoundError for an unknown one or another device's."""
        self.sweep()
        upload = self._uploads.get(upload_id)
        if upload is None or upload.device_id != device_id:
            raise NotFoundError(
                f"no upload {upload_id[:80]!r} for this device (expired with its round, or "
                "never created): create a new one with POST /device/v1/uploads"
            )
        return upload

    async def write(self, upload: StagedUpload, start: int, data: bytes) -> None:
        """Store a chunk at ``start``. Bytes already held must be equal (a resent chunk is
        harmless); a chunk that contradicts them is refused and nothing is written."""
        if upload.state != "open":
            raise StaleRoundError(f"upload {upload.id} is {upload.state}: it takes no chunks")
        end = start + len(data)
        for s, e in upload.received.overlaps(start, end):
            try:
                held = await asyncio.to_thread(_pread, upload.path, s, e - s)
            except FileNotFoundError:
                raise StaleRoundError(f"upload {upload.id} expired with its round") from None
            if held != data[s - start : e - start]:
                raise ConflictError(
                    f"bytes {s}-{e - 1} differ from those already received for this upload"
                )
        try:
            await asyncio.to_thread(_pwrite, upload.path, start, data)
        except FileNotFoundError:
            raise StaleRoundError(f"upload {upload.id} expired with its round") from None
        upload.received.add(start, end)

    async def sha256(self, upload: StagedUpload) -> str:
        return await asyncio.to_thread(_file_sha256, upload.path)

    async def chunks(self, upload: StagedUpload) -> AsyncIterator[bytes]:
        """The whole update, chunk by chunk, read off the event loop."""
        for start in range(0, upload.size, CHUNK_BYTES):
            length = min(CHUNK_BYTES, upload.size - start)
            yield await asyncio.to_thread(_pread, upload.path, start, length)

    def finish(self, upload: StagedUpload, state: str, detail: str) -> None:
        """Settle an upload: its file goes, a tombstone stays until its round is over."""
        upload.state = state
        upload.detail = detail
        upload.path.unlink(missing_ok=True)

    def sweep(self) -> None:
        """Drop uploads (and tombstones) whose round is over."""
        now = self._clock()
        for upload in [u for u in self._uploads.values() if u.expires_at <= now]:
            if upload.state == "finalizing":
                continue  # the core holds it; it settles it
            upload.path.unlink(missing_ok=True)
            del self._uploads[upload.id]


def _pread(path: Path, start: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, start)
    finally:
        os.close(fd)


def _pwrite(path: Path, start: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        view = memoryview(data)
        while view:
            written = os.pwrite(fd, view, start)
            view, start = view[written:], start + written
    finally:
        os.close(fd)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()
