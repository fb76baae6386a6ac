"""The device credential and key an agent keeps in its state dir, so a restart needs no new
enrolment: ``credential.json`` and ``device.key`` (its Ed25519 key, ``core.identity``),
both readable by their owner only."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from flotilla.core.files import write_private
from flotilla.core.identity import KEY_FILE, DeviceIdentity
from flotilla.core.work import DeviceCredential

CREDENTIAL_FILE = "credential.json"


@dataclass(frozen=True, slots=True)
class CredentialFile:
    """``credential.json`` in ``state_dir`` (nothing kept when None), valid for ``server``
    only: a credential one server issued means nothing to another."""

    state_dir: Path | None
    server: str

    def load(self) -> DeviceCredential | None:
        if self.state_dir is None:
            return None
        path = self.state_dir / CREDENTIAL_FILE
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        if data.get("server") != self.server:
            return None
        return DeviceCredential(data["device_id"], data["secret"])

    def save(self, credential: DeviceCredential) -> None:
        if self.state_dir is None:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "server": self.server,
            "device_id": credential.device_id,
            "secret": credential.secret,
        }
        write_private(self.state_dir / CREDENTIAL_FILE, json.dumps(record))

    def identity(self) -> DeviceIdentity | None:
        """The key this device enrolled with; None if none is kept (or none was made)."""
        return None if self.state_dir is None else DeviceIdentity.load(self.state_dir / KEY_FILE)

    def save_identity(self, identity: DeviceIdentity) -> None:
        if self.state_dir is not None:
            identity.save(self.state_dir / KEY_FILE)

    def forget(self) -> None:
        if self.state_dir is not None:
            (self.state_dir / CREDENTIAL_FILE).unlink(missing_ok=True)
            (self.state_dir / KEY_FILE).unlink(missing_ok=True)
