"""Two server processes on one PostgreSQL database and one state directory: one leads
(runs the jobs, serves devices), the other stands by (serves operators, turns devices
away). The leader is killed with kill -9 mid-round: the standby takes over within twice
the lease, the agents (given both addresses) follow it, and the job finishes there with
each round committed once. The killed one restarts as a standby and, when the other stops,
takes the jobs again.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faults.test_server_kills import TASK, job_file
from tests.support.lifetime import bound
from tests.support.postgres import Cluster
from tests.support.processes import ServerProcess, terminate_all

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(600)]

LEASE_S = 3.0
AGENTS = 3
ROUNDS = 25


def server(tmp_path: Path, name: str, url: str) -> ServerProcess:
    srv = ServerProcess(
        tmp_path / "state", url, extra=("--liveness", "20", "--lease", str(LEASE_S))
    )
    srv.log = tmp_path / f"{name}.log"
    return srv


def leads(srv: ServerProcess) -> bool:
    return "leading the deployment" in srv.log.read_text()


def wait(what: str, done: object, timeout_s: float) -> float:
    """Seconds until ``done()`` holds (fails the test after ``timeout_s``)."""
    start = time.monotonic()
    while not done():  # type: ignore[operator]
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - start


def test_the_standby_takes_over_a_killed_leaders_jobs_and_the_old_leader_comes_back(
    cluster: Cluster, tmp_path: Path
) -> None:
    a, b = server(tmp_path, "a", cluster.url), server(tmp_path, "b", cluster.url)
    agents: list[subprocess.Popen[bytes]] = []
    try:
        a.start()
        wait("a to lead", lambda: leads(a), 30)
        b.start()
        time.sleep(LEASE_S)
        assert not leads(b), "two leaders"
        token = a.token()
        both = f"{a.address},{b.address}"
        for i in range(AGENTS):
            argv = [sys.executable, "-m", "flotilla", "client", "--server", both,
                    f"--token={token}", "--task", TASK, "--shard", f"{i}/{AGENTS}"]  # fmt: skip
            log = (tmp_path / f"agent-{i}.log").open("wb")
            agents.append(subprocess.Popen(bound(argv), stdout=log, stderr=subprocess.STDOUT))
        spec = job_file(tmp_path / "job.toml")
        # Cancelled through the standby: the leader's runner stops within a third of a lease.
        endless = b.submit(spec, "job.rounds=100000", "job.name=endless")
        b.wait_rounds(endless, 1, timeout=180)
        b.operator("job", "cancel", endless)
        time.sleep(LEASE_S)
        stopped_at = len(cluster.rounds(endless))
        time.sleep(LEASE_S)
        assert len(cluster.rounds(endless)) == stopped_at, "still running"
        job_id = b.submit(spec, f"job.rounds={ROUNDS}")  # through the standby
        b.wait_rounds(job_id, 5, timeout=180)  # the standby reads the shared database
        a.kill9()
        took_s = wait("b to take over", lambda: leads(b), 2 * LEASE_S)
        status = b.wait_for(job_id, timeout=300)
        assert status["state"] == "completed", status
        assert cluster.rounds(job_id) == list(range(1, ROUNDS + 1))
        print(f"b led {took_s:.1f}s after a was killed")

        a.start()  # back, as a standby
        time.sleep(LEASE_S)
        assert len(re.findall("leading the deployment", a.log.read_text())) == 1
        assert b.proc is not None
        b.proc.send_signal(signal.SIGTERM)  # a clean stop releases the lease at once
        assert b.proc.wait(15) == 0
        wait("a to lead again", lambda: a.log.read_text().count("leading the deployment") == 2,
             2 * LEASE_S)  # fmt: skip
        again = a.submit(spec, "job.rounds=5", "job.name=again")
        status = a.wait_for(again, timeout=300)
        assert status["state"] == "completed", status
        assert cluster.rounds(again) == list(range(1, 6))
        assert all(p.poll() is None for p in agents), "agents follow the leader"
    finally:
        terminate_all(agents)  # type: ignore[arg-type]
        a.stop()
        b.stop()
