"""Twenty kill -9s of a real server during two jobs: nothing committed is lost or repeated.

A ``flotilla server`` process (SQLite in its state directory) runs two jobs of the
synthetic 100k-parameter task for four real ``flotilla client`` processes, and is killed
with SIGKILL at random moments (a fresh random seed each run, printed to reproduce it)
and started again on the same state directory and port, twenty times. The agents ride
through every outage on their own. Afterwards the books are read straight from the
database and the blob store: every round 1..R of each job committed exactly once, every
checkpoint row's blob present with the SHA-256 and size the row names, and SQLite's
``PRAGMA integrity_check`` is ``ok``.
"""

from __future__ import annotations

import hashlib
import os
import random
import sqlite3
import time
from pathlib import Path

import pytest

from tests.support.processes import AgentFleet, ServerProcess

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(900)]

TASK = "flotilla.tasks.synthetic:Linear100K"
KILLS = 20
ROUNDS = 30
AGENTS = 4
#: A kill lands this long (seconds, uniform) after the server is listening again: before,
#: during and after jobs resume, rounds dispatch, uploads stream and commits write.
KILL_AFTER_S = (0.2, 2.5)
#: Every few kills the test waits until a job commits again, so the kills cannot starve it.
PROGRESS_EVERY = 5
PROGRESS_TIMEOUT_S = 120.0
FINISH_TIMEOUT_S = 300.0


def job_file(path: Path) -> Path:
    path.write_text(
        f'[job]\nname = "kills"\ntask = "{TASK}"\nrounds = {ROUNDS}\n'
        "clients_per_round = 2\nmin_quorum = 1\nround_deadline_s = 10.0\n"
    )
    return path


def committed(state_dir: Path) -> dict[str, int]:
    """Rounds committed per job, from the database (also while the server is down)."""
    with sqlite3.connect(state_dir / "flotilla.db", timeout=30) as db:
        return dict(db.execute("SELECT id, rounds_committed FROM jobs").fetchall())


def test_twenty_kill_9s_during_two_jobs_lose_nothing_and_commit_each_round_once(
    sqlite_server: ServerProcess, tmp_path: Path
) -> None:
    server = sqlite_server
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"kill schedule seed: {seed}")
    rng = random.Random(seed)
    fleet = AgentFleet(server, server.token(), tmp_path)
    try:
        fleet.start(AGENTS, task=TASK)
        spec = job_file(tmp_path / "kills.toml")
        jobs = [server.submit(spec, f"job.name=kills-{i}", f"job.seed={i}") for i in range(2)]
        server.wait_rounds(jobs[0], 1, timeout=PROGRESS_TIMEOUT_S)  # agents import torch
        for kill in range(1, KILLS + 1):
            time.sleep(rng.uniform(*KILL_AFTER_S))
            server.kill9()
            before = sum(committed(server.state_dir).values())
            server.start()
            if kill % PROGRESS_EVERY == 0 and before < 2 * ROUNDS:
                deadline = time.monotonic() + PROGRESS_TIMEOUT_S
                while sum(committed(server.state_dir).values()) <= before:
                    assert time.monotonic() < deadline, f"no round committed after kill {kill}"
                    time.sleep(0.2)
        assert fleet.alive() == AGENTS, "agents ride through every outage"
        for job_id in jobs:
            status = server.wait_for(job_id, timeout=FINISH_TIMEOUT_S)
            assert status["state"] == "completed", status
    finally:
        fleet.stop()
        server.stop()

    db_path = server.state_dir / "flotilla.db"
    with sqlite3.connect(db_path) as db:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        for job_id in jobs:
            rounds = [r for (r,) in db.execute(
                "SELECT round FROM rounds WHERE job_id = ? ORDER BY round", (job_id,))]  # fmt: skip
            assert rounds == list(range(1, ROUNDS + 1)), f"{job_id}: each round exactly once"
            (total,) = db.execute(
                "SELECT rounds_committed FROM jobs WHERE id = ?", (job_id,)
            ).fetchone()
            assert total == ROUNDS
            keys = db.execute(
                "SELECT round, device_id FROM participations WHERE job_id = ?", (job_id,)
            ).fetchall()
            assert len(keys) == len(set(keys)) and {r for r, _ in keys} == set(rounds)
        checkpoints = db.execute("SELECT sha256, size_bytes FROM checkpoints").fetchall()
        named = {sha for (sha,) in db.execute("SELECT checkpoint_sha256 FROM rounds")}
    assert named <= {sha for sha, _ in checkpoints}, "every round names a checkpoint row"
    blobs = server.state_dir / "blobs"
    for sha, size in checkpoints:
        data = (blobs / sha[:2] / sha).read_bytes()
        assert len(data) == size and hashlib.sha256(data).hexdigest() == sha, sha
