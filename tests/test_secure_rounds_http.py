"""A secure round with HTTP devices in it: a real ``flotilla server`` process, 6 gRPC
agents and 4 ``flotilla-lite`` processes (NumPy over HTTP) mask their updates together;
every round unmasks the sum of all ten and the job completes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.lifetime import bound
from tests.support.processes import AgentFleet, ServerProcess, flotilla

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DIGITS = "flotilla.tasks.digits:DigitsTask"
DEVICES = 10
AGENTS = 6


def _lite(server: ServerProcess, token: str, shard: Path, state: Path) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, "-m", "flotilla.mobile.lite", "--server",
        f"http://127.0.0.1:{server.http_port}", "--token", token, "--data", str(shard),
        "--state-dir", str(state), "--device-class", "lite",
    ]  # fmt: skip
    log = (state.parent / f"{state.name}.log").open("w")
    return subprocess.Popen(bound(cmd), stdout=log, stderr=subprocess.STDOUT, text=True)


def test_lite_devices_and_agents_run_secure_rounds_together(
    server: ServerProcess, fleet: AgentFleet, digits_spec: Path, tmp_path: Path
) -> None:
    fleet.start(AGENTS, of=DEVICES)
    token = server.token()
    lites = []
    for i in range(AGENTS, DEVICES):
        shard = tmp_path / f"shard{i}.npz"
        flotilla("data", "shard", "--task", DIGITS, "--shard", f"{i}/{DEVICES}", "--alpha", "0.5",
                 "--out", str(shard))  # fmt: skip
        lites.append(_lite(server, token, shard, tmp_path / f"lite{i}"))
    try:
        server.wait_devices(DEVICES, timeout=90)
        job_id = server.submit(
            digits_spec, "job.rounds=2", f"job.clients_per_round={DEVICES}",
            f"job.min_quorum={DEVICES - 2}", "privacy.secure_aggregation=true",
            "privacy.stage_timeout_s=20",
        )  # fmt: skip
        status = server.wait_for(job_id, timeout=200)
        assert status["state"] == "completed", status
        lite_ids = {
            d["id"]
            for d in json.loads(server.operator("devices", "list", "--json").stdout)
            if d.get("device_class") == "lite"
        }
        assert len(lite_ids) == DEVICES - AGENTS, lite_ids
        rounds = server.status(job_id, rounds=True)["rounds"]
        assert len(rounds) == 2
        for r in rounds:
            assert r["metrics"]["secagg_survivors"] == DEVICES, r
            assert lite_ids <= set(r["participants"]), r
        assert all(p.poll() is None for p in lites), "a lite client died"
    finally:
        for p in lites:
            p.terminate()
        for p in lites:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
