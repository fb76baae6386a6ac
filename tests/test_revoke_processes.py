"""``flotilla devices revoke`` against real processes: a gRPC agent and an HTTP lite client,
each idle in its long poll, are refused at their next poll and stop (exit 3, refused
credentials); the operator sees them revoked and can read the refusal record."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.lifetime import bound
from tests.support.processes import AgentFleet, ServerProcess, flotilla

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

DIGITS = "flotilla.tasks.digits:DigitsTask"


def _exit_code(proc: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None


def test_revoked_devices_on_both_edges_are_refused_at_their_next_poll(
    server: ServerProcess, fleet: AgentFleet, tmp_path: Path
) -> None:
    fleet.start(1)
    shard = tmp_path / "shard.npz"
    flotilla("data", "shard", "--task", DIGITS, "--shard", "1/2", "--out", str(shard))
    log = (tmp_path / "lite.log").open("wb")
    lite = subprocess.Popen(
        bound([sys.executable, "-m", "flotilla.mobile.lite", "--server",
               f"http://127.0.0.1:{server.http_port}", "--token", fleet.token,
               "--data", str(shard), "--state-dir", str(tmp_path / "lite")]),
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        server.wait_devices(2, timeout=90)
        assert (tmp_path / "lite" / "device.key").stat().st_mode & 0o777 == 0o600
        devices = json.loads(server.operator("devices", "list", "--json").stdout)
        for device in devices:
            out = server.operator("devices", "revoke", device["id"], "--json").stdout
            assert json.loads(out)["device_id"] == device["id"]
        began = time.monotonic()
        codes = [_exit_code(p, 30) for p in (*fleet.procs, lite)]
        assert codes == [3, 3], (codes, (tmp_path / "lite.log").read_text()[-2000:])
        assert time.monotonic() - began < 30, "refused within one poll, not at a timeout"
        listed = json.loads(server.operator("devices", "list", "--json").stdout)
        assert {d["state"] for d in listed} == {"revoked"}
        refusals = json.loads(server.operator("devices", "refusals", "--json").stdout)
        assert refusals == []  # idle devices had no update to refuse
        missing = server.operator("devices", "revoke", "dev-nope", check=False)
        assert missing.returncode == 4 and "unknown device" in missing.stderr
    finally:
        if lite.poll() is None:
            lite.kill()
        lite.wait(10)
