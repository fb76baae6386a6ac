"""What a light device keeps in ``--state-dir``, so a restart or a broken link loses nothing.

::

    credential.json              device id + secret, for one server (mode 0600)
    device.key                   its Ed25519 key, made at enrolment: signs every upload
    models/<sha256>.safetensors  the latest model (``.part`` while it downloads: a restart
                                 resumes it with HTTP Range)
    jobs/<kind>-<hash>.safetensors   per-job momentum and error-feedback residuals

Every file is written whole (temporary file, fsync, rename) and readable by its owner only.
A file that does not read back as it was written is dropped with a warning, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

from flotilla.core.errors import WireError
from flotilla.core.files import write_private_atomic
from flotilla.core.identity import KEY_FILE, DeviceIdentity
from flotilla.core.tensors import ModelState, decode_state, encode_state, read_metadata
from flotilla.core.work import DeviceCredential

log = logging.getLogger(__name__)

CREDENTIAL_FILE = "credential.json"
_STATE_FORMAT = "flotilla.lite-state/1"
_MAX_STATE_BYTES = 1 << 34


class LiteState:
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
        write_private_atomic(self.directory / CREDENTIAL_FILE, json.dumps(record).encode())

    def forget_credential(self) -> None:
        (self.directory / CREDENTIAL_FILE).unlink(missing_ok=True)
        (self.directory / KEY_FILE).unlink(missing_ok=True)

    def identity(self) -> DeviceIdentity | None:
        """The key this device enrolled with; None if none was kept (or it is unreadable)."""
        try:
            return DeviceIdentity.load(self.directory / KEY_FILE)
        except (OSError, WireError) as exc:
            log.warning("key file is unusable (%s); enrolling again", exc)
            return None

    def save_identity(self, identity: DeviceIdentity) -> None:
        identity.save(self.directory / KEY_FILE)

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
        write_private_atomic(self._job_path(kind, job_id), encode_state(state, meta))

    def _job_path(self, kind: str, job_id: str) -> Path:
        digest = hashlib.sha256(job_id.encode()).hexdigest()[:32]
        if not re.fullmatch(r"[a-z]+", kind):
            raise ValueError(f"job state kind must be lowercase letters, got {kind!r}")
        return self.directory / "jobs" / f"{kind}-{digest}.safetensors"
