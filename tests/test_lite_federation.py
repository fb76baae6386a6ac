"""Torch-free devices in a real federation: 4 ``flotilla client`` agents (torch, gRPC) and 4
``flotilla-lite`` processes (NumPy, HTTP, from a venv with only the base install) train one
digits job together; the job reaches the held-out accuracy target and the lite devices are
in most rounds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.base_venv import BaseVenv
from tests.support.lifetime import bound
from tests.support.processes import AgentFleet, ServerProcess, flotilla, terminate_all

# One worker holds the session's base-install venv (made once, ~10 s) for every test using it.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420), pytest.mark.xdist_group("base-venv")]

SHARDS = 8
DIGITS = "flotilla.tasks.digits:DigitsTask"


def _lite(
    venv: BaseVenv, server: ServerProcess, token: str, shard: Path, state: Path
) -> subprocess.Popen[str]:
    cmd = [
        str(venv.script("flotilla-lite")), "--server", f"http://127.0.0.1:{server.http_port}",
        "--token", token, "--data", str(shard), "--state-dir", str(state), "--device-class", "lite",
    ]  # fmt: skip
    log = (state.parent / f"{state.name}.log").open("w")
    return subprocess.Popen(
        bound(cmd), stdout=log, stderr=subprocess.STDOUT, env=venv.env(), text=True
    )


def test_lite_clients_and_agents_train_one_job_to_the_target(
    server: ServerProcess, fleet: AgentFleet, digits_spec: Path, base_venv: BaseVenv, tmp_path: Path
) -> None:
    probe = "import importlib.util as u; print(u.find_spec('torch'), u.find_spec('grpc'))"
    gone = subprocess.run(
        bound([str(base_venv.python), "-c", probe]),
        env=base_venv.env(), capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert gone.stdout.split() == ["None", "None"], "the lite venv must have neither torch nor grpc"

    fleet.start(4, of=SHARDS)
    token = server.token()
    lites = []
    for i in range(4, SHARDS):
        shard = tmp_path / f"shard{i}.npz"
        flotilla("data", "shard", "--task", DIGITS, "--shard", f"{i}/{SHARDS}", "--alpha", "0.5",
                 "--out", str(shard))  # fmt: skip
        lites.append(_lite(base_venv, server, token, shard, tmp_path / f"lite{i}"))
    try:
        server.wait_devices(SHARDS, timeout=90)
        job_id = server.submit(
            digits_spec, "job.rounds=20", f"job.clients_per_round={SHARDS}",
            f"job.min_quorum={SHARDS - 2}", "data.alpha=0.5",
        )  # fmt: skip
        status = server.wait_for(job_id, timeout=300)
        assert status["state"] == "completed", status
        assert status["metrics"]["accuracy"] >= 0.90, status["metrics"]
        lite_ids = {
            d["id"]
            for d in json.loads(server.operator("devices", "list", "--json").stdout)
            if d.get("device_class") == "lite"
        }
        assert len(lite_ids) == 4, lite_ids
        rounds = server.status(job_id, rounds=True)["rounds"]
        with_lite = [r for r in rounds if lite_ids & set(r.get("participants", []))]
        assert len(with_lite) > len(rounds) / 2, rounds
        assert all(p.poll() is None for p in lites), "a lite client died"
    finally:
        terminate_all(lites)


def test_a_refused_token_stops_the_lite_client_at_once(
    server: ServerProcess, tmp_path: Path
) -> None:
    shard = tmp_path / "shard.npz"
    flotilla("data", "shard", "--task", DIGITS, "--shard", "0/4", "--out", str(shard))
    done = subprocess.run(
        bound([sys.executable, "-m", "flotilla.mobile.lite", "--server",
               f"http://127.0.0.1:{server.http_port}", "--token", "not-a-token",
               "--data", str(shard), "--state-dir", str(tmp_path / "lite")]),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 3, done
    assert "refused" in done.stderr and "token" in done.stderr, done.stderr
    assert not (tmp_path / "lite" / "credential.json").exists()
