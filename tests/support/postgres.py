"""A PostgreSQL cluster of a test's own: ``initdb`` in a temporary directory, the server
run as the ``postgres`` user, bound to the test's life, on a free loopback port. For tests
that restart or share a database across processes without touching the one on 5432."""

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
from typing import Any

import pytest

from tests.support.lifetime import bound

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

    def rounds(self, job_id: str) -> list[int]:
        """The rounds of ``job_id`` committed in this cluster's database, in order."""
        rows = self._query("SELECT round FROM rounds WHERE job_id = $1 ORDER BY round", job_id)
        return [r["round"] for r in rows]

    def holders(self) -> dict[str, int]:
        """Job id -> process id of the server holding its lease now (unexpired ones)."""
        rows = self._query(
            "SELECT job_id, holder FROM job_leases WHERE expires_at > $1", time.time()
        )
        return {r["job_id"]: int(r["holder"].split(":")[1]) for r in rows}

    def _query(self, sql: str, *args: object) -> list[Any]:
        import asyncpg

        async def read() -> list[Any]:
            conn = await asyncpg.connect(self.url)
            try:
                return list(await conn.fetch(sql, *args))
            finally:
                await conn.close()

        return asyncio.run(read())

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
