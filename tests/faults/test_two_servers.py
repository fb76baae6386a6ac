"""Two server processes on one PostgreSQL database and one state directory share the
jobs: each runs one of two, the agents (given both addresses) serve both, and idle devices
move to the server whose job lacks them. One server is killed with kill -9 mid-round: the
other takes its job over within twice the lease, and its devices follow. The killed one
restarts, is given a job back, and gets devices for it. Every round of each job is
committed exactly once. (Rounds of the tiny task take a fraction of a second, so the two
shared jobs run until cancelled; a finite one completes at the end.)
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.faults.test_server_kills import TASK, job_file
from tests.support.lifetime import bound
from tests.support.postgres import Cluster
from tests.support.processes import ServerProcess, terminate_all

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(600)]

LEASE_S = 3.0
AGENTS = 4
ROUNDS = 5


def server(tmp_path: Path, name: str, url: str) -> ServerProcess:
    srv = ServerProcess(
        tmp_path / "state", url, extra=("--liveness", "20", "--lease", str(LEASE_S))
    )
    srv.log = tmp_path / f"{name}.log"
    return srv


def pid(srv: ServerProcess) -> int:
    assert srv.proc is not None
    return srv.proc.pid


def wait(what: str, done: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until ``done()`` holds (fails the test after ``timeout_s``)."""
    start = time.monotonic()
    while not done():
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - start


def test_two_servers_share_the_jobs_survive_a_kill_9_and_share_again_after_a_restart(
    cluster: Cluster, tmp_path: Path
) -> None:
    a, b = server(tmp_path, "a", cluster.url), server(tmp_path, "b", cluster.url)
    agents: list[subprocess.Popen[bytes]] = []
    try:
        a.start()
        b.start()
        token = a.token()
        for i in range(AGENTS):
            first, second = (a, b) if i % 2 else (b, a)  # half start at each server
            argv = [sys.executable, "-m", "flotilla", "client",
                    "--server", f"{first.address},{second.address}", f"--token={token}",
                    "--task", TASK, "--shard", f"{i}/{AGENTS}"]  # fmt: skip
            log = (tmp_path / f"agent-{i}.log").open("wb")
            agents.append(subprocess.Popen(bound(argv), stdout=log, stderr=subprocess.STDOUT))
        spec = job_file(tmp_path / "job.toml")
        jobs = [b.submit(spec, "job.rounds=100000", "job.name=first"),
                a.submit(spec, "job.rounds=100000", "job.name=second")]  # fmt: skip
        wait("one job on each server",
             lambda: set(cluster.holders().values()) == {pid(a), pid(b)}, 4 * LEASE_S)  # fmt: skip
        for job_id in jobs:  # both run: the devices went where they were needed
            b.wait_rounds(job_id, 3, timeout=180)

        killed = cluster.holders()
        a_jobs = [j for j, p in killed.items() if p == pid(a)]
        a.kill9()
        took_s = wait("b to take a's job over",
                      lambda: set(cluster.holders().values()) == {pid(b)}, 2 * LEASE_S)  # fmt: skip
        at_takeover = {j: len(cluster.rounds(j)) for j in a_jobs}
        b.wait_rounds(a_jobs[0], at_takeover[a_jobs[0]] + 2, timeout=180)  # it runs on b
        print(f"b took over {a_jobs} {took_s:.1f}s after a was killed")

        a.start()  # back: b gives a job back, and idle devices follow it
        wait("a to run a job again", lambda: pid(a) in cluster.holders().values(), 6 * LEASE_S)
        a_again = [j for j, p in cluster.holders().items() if p == pid(a)]
        resumed_at = len(cluster.rounds(a_again[0]))
        b.wait_rounds(a_again[0], resumed_at + 2, timeout=180)  # a's job gets devices

        for job_id in jobs:
            b.operator("job", "cancel", job_id)  # through either server: its holder stops it
        time.sleep(LEASE_S)
        ran = {job_id: cluster.rounds(job_id) for job_id in jobs}
        for job_id, rounds in ran.items():
            assert rounds == list(range(1, len(rounds) + 1)), f"{job_id}: each round once"
        time.sleep(LEASE_S)
        assert {j: cluster.rounds(j) for j in jobs} == ran, "cancelled, yet still running"
        finite = a.submit(spec, f"job.rounds={ROUNDS}", "job.name=finite")
        status = b.wait_for(finite, timeout=300)
        assert status["state"] == "completed", status
        assert cluster.rounds(finite) == list(range(1, ROUNDS + 1))
        assert all(p.poll() is None for p in agents), "agents follow the jobs"
    finally:
        terminate_all(agents)  # type: ignore[arg-type]
        a.stop()
        b.stop()
