"""The network between the devices and the server is cut mid-job, then restored: the
devices reconnect by themselves and the job completes, each round committed once.

Server and agents live in separate network namespaces joined by the user-space impaired
link of ``tests/support/netimpair.py``; the cut drops every packet both ways for longer
than a round's deadline, so the round in flight runs out and the job must retry it.
"""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faults.test_server_kills import TASK, committed, job_file
from tests.support.lifetime import bound
from tests.support.netimpair import Impairment, impaired_network

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(600)]

AGENTS = 3
ROUNDS = 15
CUT_FOR_S = 12.0
PORT = 7070


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "flotilla", *args]


def test_devices_reconnect_after_a_network_cut_and_the_job_completes(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with impaired_network(2) as net:
        server_ip = net.ip(1)
        log = tmp_path / "server.log"
        with log.open("wb") as out:
            net.popen(1, cli("server", "--host", server_ip, "--port", str(PORT), "--no-http",
                             "--state-dir", str(state), "--liveness", "30"),
                      stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 90
        while not re.search(r"listening on", log.read_text()):
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        token = subprocess.run(
            bound(cli("server", "token", "create", "--state-dir", str(state))),
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout.strip().splitlines()[-1]  # fmt: skip
        agents = [
            net.popen(0, cli("client", "--server", f"{server_ip}:{PORT}", f"--token={token}",
                             "--task", TASK, "--shard", f"{i}/{AGENTS}"),
                      stdout=(tmp_path / f"agent-{i}.log").open("wb"),
                      stderr=subprocess.STDOUT)
            for i in range(AGENTS)
        ]  # fmt: skip
        spec = job_file(tmp_path / "job.toml")
        submitted = net.run(
            1, cli("job", "submit", str(spec), "--server", f"{server_ip}:{PORT}",
                   "--state-dir", str(state), "--set", f"job.rounds={ROUNDS}",
                   "--set", "job.round_deadline_s=5"),
            timeout=120, text=True,
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.strip().splitlines()[-1]

        def rounds_now() -> int:
            return committed(state).get(job_id, 0)

        deadline = time.monotonic() + 180
        while rounds_now() < 3:
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.2)
        for host in (0, 1):
            net.set_impairment(Impairment(loss=1.0), src=host)
        cut_at = rounds_now()
        time.sleep(CUT_FOR_S)
        assert rounds_now() <= cut_at + 1, "rounds committed with no devices reachable"
        for host in (0, 1):
            net.set_impairment(Impairment(), src=host)
        deadline = time.monotonic() + 300
        while rounds_now() < ROUNDS:
            assert time.monotonic() < deadline, f"stuck at {rounds_now()} rounds after the cut"
            time.sleep(0.5)
        assert all(a.poll() is None for a in agents), "agents survive the cut"
    with sqlite3.connect(state / "flotilla.db") as db:
        rounds = [r for (r,) in db.execute(
            "SELECT round FROM rounds WHERE job_id = ? ORDER BY round", (job_id,))]  # fmt: skip
        (state_now,) = db.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
    assert rounds == list(range(1, ROUNDS + 1)) and state_now == "completed"
