"""The device credential an agent keeps in its state dir, so a restart needs no new enrolment."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from flotilla.core.files import write_private
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

    def forget(self) -> None:
        if self.state_dir is not None:
            (self.state_dir / CREDENTIAL_FILE).unlink(missing_ok=True)
