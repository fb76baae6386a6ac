"""What a light device keeps in ``--state-dir``, so a restart or a broken link loses nothing.

::

    credential.json              device id + secret, for one server (mode 0600)
    downloads/<sha256>.part      a model download so far (resume with HTTP Range)
    uploads/<sha256>.json        an upload in progress: its round, header and acked ranges
    uploads/<sha256>.bin         ... and its payload (resume the missing chunks)
    jobs/<kind>-<hash>.safetensors   per-job momentum and error-feedback residuals

Every file is written whole (temporary file, fsync, rename) and readable by its owner only.
A file that does not read back as it was written is dropped with a warning, never trusted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from flotilla.core.errors import IntegrityError, WireError
from flotilla.core.tensors import ModelState, decode_state, encode_state, read_metadata
from flotilla.core.work import DeviceCredential, RoundRef

log = logging.getLogger(__name__)

CREDENTIAL_FILE = "credential.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_STATE_FORMAT = "flotilla.lite-state/1"
_MAX_STATE_BYTES = 1 << 34


def write_private(path: Path, data: bytes) -> None:
    """Replace ``path`` whole, readable by its owner only: temporary file, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _checked_sha256(sha256: str) -> str:
    """A SHA-256 as 64 lowercase hex digits: also what makes it a safe file name."""
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        raise WireError(f"not a SHA-256 (64 lowercase hex digits): {str(sha256)[:80]!r}")
    return sha256


@dataclass(frozen=True, slots=True)
class PartialDownload:
    """A blob being downloaded to ``path``; :meth:`offset` is where a ``Range`` resumes."""

    path: Path
    sha256: str
    size: int

    def offset(self) -> int:
        """Bytes held so far (a part longer than the blob is discarded: start again)."""
        try:
            held = self.path.stat().st_size
        except FileNotFoundError:
            return 0
        if held > self.size:
            self.discard()
            return 0
        return held

    def append(self, offset: int, chunk: bytes | memoryview) -> int:
        """Write ``chunk`` at ``offset`` (which must be :meth:`offset`); the new offset."""
        held = self.offset()
        if offset != held:
            raise WireError(f"download chunk at byte {offset}, {held} bytes held")
        if held + len(chunk) > self.size:
            raise WireError(f"download longer than its declared {self.size} bytes")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as fh:
            fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
        return held + len(chunk)

    def finish(self) -> bytes:
        """The whole blob, checked against its size and SHA-256, and the part file gone;
        IntegrityError (part discarded: the download starts over) when it does not match."""
        data = self.path.read_bytes() if self.path.exists() else b""
        self.discard()
        if len(data) != self.size:
            raise IntegrityError(f"download holds {len(data)} of {self.size} bytes")
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise IntegrityError("downloaded blob does not match its SHA-256")
        return data

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class PendingUpload:
    """An update on its way: the round it answers, its header fields, the server's upload id
    (empty until created) and the byte ranges the server has acknowledged."""

    ref: RoundRef
    payload_sha256: str
    payload_size: int
    codec: str
    num_samples: int
    metrics: dict[str, float] = field(default_factory=dict)
    upload_id: str = ""
    acked: tuple[tuple[int, int], ...] = ()

    def with_ack(self, start: int, end: int) -> PendingUpload:
        """This upload with ``[start, end)`` acknowledged (ranges merged)."""
        if not 0 <= start <= end <= self.payload_size:
            raise WireError(f"ack [{start}, {end}) outside the {self.payload_size}-byte payload")
        merged: list[tuple[int, int]] = []
        for a, b in sorted((*self.acked, (start, end))):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        return dataclasses.replace(self, acked=tuple(merged))

    def missing(self, chunk_bytes: int) -> list[tuple[int, int]]:
        """The ``[start, end)`` chunks (at most ``chunk_bytes`` each) not yet acknowledged."""
        gaps, pos = [], 0
        for a, b in (*self.acked, (self.payload_size, self.payload_size)):
            gaps += [(s, min(s + chunk_bytes, a)) for s in range(pos, a, chunk_bytes)]
            pos = max(pos, b)
        return gaps

    @property
    def complete(self) -> bool:
        return self.acked == ((0, self.payload_size),) or self.payload_size == 0

    def to_json(self) -> str:
        record = dataclasses.asdict(self)
        record["acked"] = [list(r) for r in self.acked]
        return json.dumps(record, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PendingUpload:
        raw = json.loads(text)
        ref = RoundRef(str(raw["ref"]["job_id"]), int(raw["ref"]["round"]),
                       str(raw["ref"]["round_token"]))  # fmt: skip
        metrics = {str(k): float(v) for k, v in raw["metrics"].items()}
        acked = tuple((int(a), int(b)) for a, b in raw["acked"])
        return cls(ref, _checked_sha256(raw["payload_sha256"]), int(raw["payload_size"]),
                   str(raw["codec"]), int(raw["num_samples"]), metrics,
                   str(raw["upload_id"]), acked)  # fmt: skip


class DeviceState:
    """The state dir of one device, for one server (a credential means nothing elsewhere)."""

    def __init__(self, directory: Path, server: str) -> None:
        self.directory = directory
        self.server = server

    # --- credential ----------------------------------------------------------------------

    def credential(self) -> DeviceCredential | None:
        """The saved credential for this server; None if none (or another server's)."""
        path = self.directory / CREDENTIAL_FILE
        try:
            raw = json.loads(path.read_text())
            if raw.get("server") != self.server:
                return None
            return DeviceCredential(str(raw["device_id"]), str(raw["secret"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            log.warning("credential file %s is unreadable (%s); enrolling again", path, exc)
            return None

    def save_credential(self, credential: DeviceCredential) -> None:
        record = {"server": self.server, "device_id": credential.device_id,
                  "secret": credential.secret}  # fmt: skip
        write_private(self.directory / CREDENTIAL_FILE, json.dumps(record).encode())

    def forget_credential(self) -> None:
        (self.directory / CREDENTIAL_FILE).unlink(missing_ok=True)

    # --- transfers -----------------------------------------------------------------------

    def download(self, sha256: str, size: int) -> PartialDownload:
        """The (possibly partial) download of blob ``sha256`` of ``size`` bytes."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise WireError(f"blob size must be a non-negative integer, got {size!r}")
        sha = _checked_sha256(sha256)
        return PartialDownload(self.directory / "downloads" / f"{sha}.part", sha, size)

    def save_upload(self, upload: PendingUpload, payload: bytes | None = None) -> None:
        """Record ``upload`` (and, the first time, its payload) before sending anything."""
        base = self._upload_path(upload.payload_sha256)
        if payload is not None:
            if hashlib.sha256(payload).hexdigest() != upload.payload_sha256:
                raise IntegrityError("upload payload does not match its SHA-256")
            write_private(base.with_suffix(".bin"), payload)
        write_private(base.with_suffix(".json"), upload.to_json().encode())

    def pending_uploads(self) -> list[tuple[PendingUpload, bytes]]:
        """Uploads recorded and not dropped, with their payloads (checked by SHA-256);
        a record that does not read back whole is dropped."""
        out = []
        for path in sorted((self.directory / "uploads").glob("*.json")):
            try:
                upload = PendingUpload.from_json(path.read_text())
                payload = path.with_suffix(".bin").read_bytes()
                if hashlib.sha256(payload).hexdigest() != upload.payload_sha256:
                    raise IntegrityError("payload does not match its SHA-256")
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                log.warning("upload record %s is unusable (%s); dropped", path, exc)
                path.unlink(missing_ok=True)
                path.with_suffix(".bin").unlink(missing_ok=True)
                continue
            out.append((upload, payload))
        return out

    def drop_upload(self, upload: PendingUpload) -> None:
        """Forget an upload: committed, refused, or its round is over."""
        base = self._upload_path(upload.payload_sha256)
        base.with_suffix(".json").unlink(missing_ok=True)
        base.with_suffix(".bin").unlink(missing_ok=True)

    def _upload_path(self, sha256: str) -> Path:
        return self.directory / "uploads" / _checked_sha256(sha256)

    # --- per-job tensors (implements rounds.JobStates) -----------------------------------

    def get(self, kind: str, job_id: str) -> ModelState | None:
        path = self._job_path(kind, job_id)
        try:
            raw = path.read_bytes()
            meta = read_metadata(raw, _MAX_STATE_BYTES)
            if meta != {"format": _STATE_FORMAT, "kind": kind, "job_id": job_id}:
                raise WireError("written for another job or kind")
            return {k: v.copy() for k, v in decode_state(raw, None, _MAX_STATE_BYTES).items()}
        except FileNotFoundError:
            return None
        except (OSError, WireError) as exc:
            log.warning("job state %s is unusable (%s); starting afresh", path, exc)
            return None

    def put(self, kind: str, job_id: str, state: ModelState) -> None:
        meta = {"format": _STATE_FORMAT, "kind": kind, "job_id": job_id}
        write_private(self._job_path(kind, job_id), encode_state(state, meta))

    def _job_path(self, kind: str, job_id: str) -> Path:
        digest = hashlib.sha256(job_id.encode()).hexdigest()[:32]
        if not re.fullmatch(r"[a-z]+", kind):
            raise ValueError(f"job state kind must be lowercase letters, got {kind!r}")
        return self.directory / "jobs" / f"{kind}-{digest}.safetensors"
