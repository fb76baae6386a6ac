"""PostgreSQL restarted under a running job: the server waits it out, retrying with
backoff, and resumes the job from its last committed round; nothing is committed twice.

The test runs a PostgreSQL cluster of its own (``initdb`` in a temporary directory, the
``postgres`` server as a child bound to this process's life, run as the ``postgres``
user), so the shared one on port 5432 is left alone.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.faults.test_server_kills import TASK, job_file
from tests.support.postgres import Cluster
from tests.support.processes import AgentFleet, ServerProcess

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(600)]

ROUNDS = 25
DOWN_FOR_S = 6.0


def test_postgres_restarted_under_a_job_the_server_waits_and_resumes_committing_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    server = ServerProcess(tmp_path / "state", cluster.url, extra=("--liveness", "20"))
    server.start()
    fleet = AgentFleet(server, server.token(), tmp_path)
    try:
        fleet.start(3, task=TASK)
        job_id = server.submit(job_file(tmp_path / "job.toml"), f"job.rounds={ROUNDS}")
        server.wait_rounds(job_id, 4, timeout=180)
        for _ in range(2):  # twice: the second outage finds a server that came back once
            cluster.stop()
            time.sleep(DOWN_FOR_S)
            assert server.proc is not None and server.proc.poll() is None, "server died"
            cluster.start()
            before = len(cluster.rounds(job_id))
            deadline = time.monotonic() + 120
            while len(cluster.rounds(job_id)) <= before and before < ROUNDS:
                assert time.monotonic() < deadline, "no round committed after the restart"
                time.sleep(0.3)
        status = server.wait_for(job_id, timeout=300)
        assert status["state"] == "completed", status
        assert fleet.alive() == 3
    finally:
        fleet.stop()
        server.stop()
    assert cluster.rounds(job_id) == list(range(1, ROUNDS + 1))
    log = server.log.read_text()
    assert "database unavailable" in log and "resuming from its last committed round" in log
