"""The disk fills up while a checkpoint is written: the round is not committed, the log
says the disk is full, the last good checkpoint stays intact, and the job carries on once
space returns.

The server's state directory (SQLite database, blob store) is a small tmpfs mounted for
this test (the suite runs as root on its machines; a mount it cannot make fails the test,
naming the reason). A filler file takes every free byte mid-job, and is deleted later.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.test_server_kills import TASK, committed, job_file
from tests.support.lifetime import bound
from tests.support.processes import AgentFleet, ServerProcess

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(600)]

ROUNDS = 20
TMPFS_SIZE = "64m"
#: How long the full disk is left full: several rounds' worth.
FULL_FOR_S = 6.0


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "state"
    where.mkdir()
    mounted = subprocess.run(
        bound(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(where)]),
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert mounted.returncode == 0, f"cannot mount a tmpfs (needs root): {mounted.stderr}"
    try:
        yield where
    finally:
        subprocess.run(bound(["umount", "-l", str(where)]), timeout=30, check=False)


def fill(disk: Path) -> Path:
    """Take every free byte of ``disk`` with one file (unbuffered writes, smaller and
    smaller, until not even 512 bytes fit)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 20, 1 << 16, 4096, 512):
            block = bytes(size)
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, block)
    finally:
        os.close(fd)
    return filler


def intact(state_dir: Path, sha: str) -> bool:
    path = state_dir / "blobs" / sha[:2] / sha
    return path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == sha


def test_a_full_disk_stops_commits_keeps_the_last_checkpoint_and_the_job_resumes(
    small_disk: Path, tmp_path: Path
) -> None:
    server = ServerProcess(small_disk, None, extra=("--liveness", "20"))
    server.start()
    fleet = AgentFleet(server, server.token(), tmp_path)
    try:
        fleet.start(3, task=TASK)
        job_id = server.submit(job_file(tmp_path / "job.toml"), f"job.rounds={ROUNDS}")
        server.wait_rounds(job_id, 4, timeout=180)
        filler = fill(small_disk)
        stopped_at = committed(small_disk)[job_id]
        time.sleep(FULL_FOR_S)
        during = committed(small_disk)[job_id]
        # At most the round whose checkpoint was already on disk slips through.
        assert during <= stopped_at + 1, "rounds kept committing on a full disk"
        log = server.log.read_text()
        assert "disk full" in log and "No space left on device" in log, log[-3000:]
        with sqlite3.connect(small_disk / "flotilla.db") as db:
            (sha,) = db.execute(
                "SELECT checkpoint_sha256 FROM jobs WHERE id = ?", (job_id,)
            ).fetchone()
        assert intact(small_disk, sha), "the last good checkpoint is intact"
        os.unlink(filler)
        status = server.wait_for(job_id, timeout=300)
        assert status["state"] == "completed", status
    finally:
        fleet.stop()
        server.stop()
    with sqlite3.connect(small_disk / "flotilla.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        rounds = [r for (r,) in db.execute(
            "SELECT round FROM rounds WHERE job_id = ? ORDER BY round", (job_id,))]  # fmt: skip
        shas = [s for (s,) in db.execute("SELECT checkpoint_sha256 FROM rounds")]
    assert rounds == list(range(1, ROUNDS + 1)), "each round committed exactly once"
    assert all(intact(small_disk, s) for s in shas)
