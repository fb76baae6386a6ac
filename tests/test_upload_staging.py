"""HTTP devices' partial uploads on disk: each server process stages in its own directory,
so servers sharing a state directory never remove each other's uploads in progress."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from flotilla.server.http.staging import UploadStaging
from tests.support.lifetime import bound


def test_a_starting_server_keeps_other_live_servers_uploads_and_clears_the_dead(
    tmp_path: Path,
) -> None:
    host = socket.gethostname()
    alive = subprocess.Popen(bound([sys.executable, "-c", "import time; time.sleep(60)"]))
    dead = subprocess.Popen(bound([sys.executable, "-c", "pass"]))
    dead.wait(30)
    try:
        for pid in (alive.pid, dead.pid, os.getpid()):
            staged = tmp_path / f"{pid}@{host}"
            staged.mkdir()
            (staged / "upload.part").write_bytes(b"partial")
        (tmp_path / f"7@{host}.example").mkdir()  # another machine's: never known gone
        staging = UploadStaging(tmp_path, 1024, clock=lambda: 0.0)
        staging.open()
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [f"{alive.pid}@{host}", f"{os.getpid()}@{host}", f"7@{host}.example"]
        )
        assert not list((tmp_path / f"{os.getpid()}@{host}").iterdir()), "its own: emptied"
        staging.close()
        assert (tmp_path / f"{alive.pid}@{host}" / "upload.part").exists()
        assert not (tmp_path / f"{os.getpid()}@{host}").exists()
    finally:
        alive.kill()
        alive.wait(30)
