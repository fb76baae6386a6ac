"""SIGTERM mid-job: the server stops taking calls, abandons the open round cleanly, exits 0
within a bounded time, and a restart on the same state directory resumes the job.

Real ``flotilla server`` and ``flotilla client`` processes; the books are read straight from
the database after each step: no half-committed round (every ``rounds`` row has its
participants, nothing past ``rounds_committed``), each round 1..R committed once at the end.
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from tests.faults.test_server_kills import TASK, committed, job_file
from tests.support.processes import AgentFleet, ServerProcess

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(600)]

ROUNDS = 30
AGENTS = 3
#: The server must be gone this long after SIGTERM: its grace for calls in flight
#: (Timeouts.server_stop_s) plus hosted children and the store, with room for a slow CI.
STOP_WITHIN_S = 15.0


def books(state_dir: Path, job_id: str) -> tuple[int, list[int], set[int]]:
    """(rounds_committed, committed round numbers, rounds with participants)."""
    with sqlite3.connect(state_dir / "flotilla.db", timeout=30) as db:
        query = "SELECT rounds_committed FROM jobs WHERE id = ?"
        (total,) = db.execute(query, (job_id,)).fetchone()
        rounds = [r for (r,) in db.execute(
            "SELECT round FROM rounds WHERE job_id = ? ORDER BY round", (job_id,))]  # fmt: skip
        members = {r for (r,) in db.execute(
            "SELECT DISTINCT round FROM participations WHERE job_id = ?", (job_id,))}  # fmt: skip
    return int(total), rounds, members


@pytest.mark.parametrize("stops", [2])
def test_sigterm_mid_round_exits_zero_in_bounded_time_and_a_restart_resumes(
    sqlite_server: ServerProcess, tmp_path: Path, stops: int
) -> None:
    server = sqlite_server
    fleet = AgentFleet(server, server.token(), tmp_path)
    try:
        fleet.start(AGENTS, task=TASK)
        job_id = server.submit(job_file(tmp_path / "job.toml"), "job.clients_per_round=3")
        for stop in range(1, stops + 1):
            server.wait_rounds(job_id, 5 * stop, timeout=180)
            assert server.proc is not None
            started = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            try:
                code = server.proc.wait(STOP_WITHIN_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"still running {STOP_WITHIN_S}s after SIGTERM")
            took = time.monotonic() - started
            assert code == 0, f"exit {code} after SIGTERM:\n{server.log.read_text()[-3000:]}"
            total, rounds, members = books(server.state_dir, job_id)
            assert rounds == list(range(1, total + 1)), "no half-committed or skipped round"
            assert members == set(rounds), "participants only for committed rounds, and all"
            print(f"stop {stop}: exited 0 after {took:.1f}s with {total} rounds committed")
            time.sleep(1.0)
            assert fleet.alive() == AGENTS, "agents outlive the server and wait for it"
            server.start()
        status = server.wait_for(job_id, timeout=300)
        assert status["state"] == "completed", status
    finally:
        fleet.stop()
        server.stop()
    total, rounds, members = books(server.state_dir, job_id)
    assert total == ROUNDS and rounds == list(range(1, ROUNDS + 1)) and members == set(rounds)
    assert committed(server.state_dir)[job_id] == ROUNDS
