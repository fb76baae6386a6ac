"""30% of the devices killed with SIGKILL at random moments, again and again, mid-job:
every round commits from its quorum or is retried, never half-committed.

Real ``flotilla client`` processes against a real server; each cycle kills a random 30% of
the live agents (mid-download, mid-training, mid-upload: wherever they are) and starts as
many new ones, which enrol afresh. The books are read from the database afterwards.
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import time
from contextlib import closing
from pathlib import Path

import pytest

from tests.faults.test_server_kills import TASK, job_file
from tests.support.processes import AgentFleet, ServerProcess

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(600)]

AGENTS = 8
KILL_SHARE = 0.3
CYCLES = 6
ROUNDS = 20
PER_ROUND = 5
QUORUM = 3
CYCLE_S = (1.0, 3.0)


def test_killing_30_percent_of_devices_repeatedly_never_half_commits_a_round(
    tmp_path: Path,
) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"kill schedule seed: {seed}")
    rng = random.Random(seed)
    server = ServerProcess(tmp_path / "state", None, extra=("--liveness", "4"))
    server.start()
    fleet = AgentFleet(server, server.token(), tmp_path)
    killed = 0
    try:
        fleet.start(AGENTS, task=TASK)
        spec = job_file(tmp_path / "job.toml")
        job_id = server.submit(
            spec, f"job.rounds={ROUNDS}", f"job.clients_per_round={PER_ROUND}",
            f"job.min_quorum={QUORUM}", "job.round_deadline_s=6",
        )  # fmt: skip
        server.wait_rounds(job_id, 1, timeout=120)
        for _ in range(CYCLES):
            time.sleep(rng.uniform(*CYCLE_S))
            live = [p for p in fleet.procs if p.poll() is None]
            victims = rng.sample(live, max(1, round(KILL_SHARE * len(live))))
            for proc in victims:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
            killed += len(victims)
            fleet.start(len(victims), task=TASK)
        status = server.wait_for(job_id, timeout=300)
        assert status["state"] == "completed", status
        # The last cycle's replacements are never killed: on a loaded machine the job may
        # finish before they have enrolled, so give them the time to (bounded).
        enrolled = wait_enrolled(server.state_dir / "flotilla.db", AGENTS + 1, timeout=60.0)
        assert enrolled > AGENTS, "no replacement enrolled in 60 s"
    finally:
        fleet.stop()
        server.stop()
    assert killed >= CYCLES

    with sqlite3.connect(server.state_dir / "flotilla.db") as db:
        rounds = [r for (r,) in db.execute(
            "SELECT round FROM rounds WHERE job_id = ? ORDER BY round", (job_id,))]  # fmt: skip
        assert rounds == list(range(1, ROUNDS + 1)), "each round committed exactly once"
        per_round = dict(db.execute(
            "SELECT round, COUNT(*) FROM participations WHERE job_id = ? GROUP BY round",
            (job_id,)).fetchall())  # fmt: skip
        devices = db.execute("SELECT COUNT(*) FROM devices").fetchone()[0]
    assert set(per_round) == set(rounds), "every committed round has its participants"
    assert all(QUORUM <= n <= PER_ROUND for n in per_round.values()), per_round
    # Replacements enrol afresh (one killed before it enrolled never shows up).
    assert AGENTS < devices <= AGENTS + killed


def wait_enrolled(db_path: Path, at_least: int, timeout: float) -> int:
    """Devices enrolled once ``at_least`` have, or at ``timeout``: what there are then."""
    deadline = time.monotonic() + timeout
    while True:
        with closing(sqlite3.connect(db_path)) as db:
            count = int(db.execute("SELECT COUNT(*) FROM devices").fetchone()[0])
        if count >= at_least or time.monotonic() > deadline:
            return count
        time.sleep(0.5)
