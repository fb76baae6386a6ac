"""PostgreSQL restarted under a running job: the server waits it out, retrying with
backoff, and resumes the job from its last committed round; nothing is committed twice.

The test runs a PostgreSQL cluster of its own (``initdb`` in a temporary directory, the
``postgres`` server as a child bound to this process's life, run as the ``postgres``
user), so the shared one on port 5432 is left alone.
"""

from __future__ import annotations

import asyncio
import glob
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.faults.test_server_kills import TASK, job_file
from tests.support.lifetime import bound
from tests.support.processes import AgentFleet, ServerProcess

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(600)]

ROUNDS = 25
DOWN_FOR_S = 6.0
AS_POSTGRES = ["setpriv", "--reuid", "postgres", "--regid", "postgres", "--clear-groups", "--"]


def _bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}")) or [shutil.which(name) or ""]
    assert found[-1], f"no {name}: the PostgreSQL server package is needed"
    return found[-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    data: Path
    port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"postgresql://root@127.0.0.1:{self.port}/postgres"

    def start(self, timeout_s: float = 60.0) -> None:
        cmd = [*AS_POSTGRES, _bin("postgres"), "-D", str(self.data), "-p", str(self.port),
               "-k", str(self.data), "-c", "listen_addresses=127.0.0.1",
               "-c", "fsync=off"]  # fmt: skip
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(bound(cmd), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            ready = subprocess.run(
                bound([_bin("pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)]),
                capture_output=True, timeout=30, check=False,
            )  # fmt: skip
            if ready.returncode == 0:
                return
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            assert time.monotonic() < deadline, "PostgreSQL did not start"
            time.sleep(0.2)

    def stop(self) -> None:
        """A fast shutdown (SIGINT): open connections are cut, as in a restart."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    root = Path(tempfile.mkdtemp(prefix="flotilla-pg-"))
    shutil.chown(root, "postgres", "postgres")
    data = root / "data"
    init = subprocess.run(
        bound([*AS_POSTGRES, _bin("initdb"), "-D", str(data), "-U", "root", "--auth=trust",
               "--no-sync"]),
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert init.returncode == 0, init.stderr[-2000:]
    pg = Cluster(data, _free_port(), root / "postgres.log")
    pg.start()
    try:
        yield pg
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


def committed_rounds(url: str, job_id: str) -> list[int]:
    import asyncpg

    async def read() -> list[int]:
        conn = await asyncpg.connect(url)
        try:
            rows = await conn.fetch(
                "SELECT round FROM rounds WHERE job_id = $1 ORDER BY round", job_id
            )
            return [r["round"] for r in rows]
        finally:
            await conn.close()

    return asyncio.run(read())


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
            before = len(committed_rounds(cluster.url, job_id))
            deadline = time.monotonic() + 120
            while len(committed_rounds(cluster.url, job_id)) <= before and before < ROUNDS:
                assert time.monotonic() < deadline, "no round committed after the restart"
                time.sleep(0.3)
        status = server.wait_for(job_id, timeout=300)
        assert status["state"] == "completed", status
        assert fleet.alive() == 3
    finally:
        fleet.stop()
        server.stop()
    assert committed_rounds(cluster.url, job_id) == list(range(1, ROUNDS + 1))
    log = server.log.read_text()
    assert "database unavailable" in log and "resuming from its last committed round" in log
