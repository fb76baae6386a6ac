"""Real processes on 127.0.0.1: a `flotilla server`, `flotilla client` agents, the operator CLI."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.support.lifetime import die_with_test

if TYPE_CHECKING:
    from flotilla.server.federation.store import Store

# Many agent processes share a couple of cores here: one math thread each, or torch's
# spinning thread pools fight over the cores and a 5 ms step takes 50 ms. Set before any
# test imports torch; agents and servers inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

DIGITS = "flotilla.tasks.digits:DigitsTask"
POSTGRES_URL = os.environ.get("FLOTILLA_TEST_POSTGRES_URL")


def database_params() -> list[Any]:
    """Every database a store runs on: SQLite always, PostgreSQL too when
    FLOTILLA_TEST_POSTGRES_URL is set (the param exists only then, so it is never skipped)."""
    params: list[Any] = [pytest.param("sqlite", id="sqlite")]
    if POSTGRES_URL:
        params.append(pytest.param("postgresql", id="postgresql", marks=pytest.mark.postgres))
    return params


def server_database_params() -> list[str]:
    """For end-to-end runs of the real server: PostgreSQL when FLOTILLA_TEST_POSTGRES_URL is
    set, else SQLite. The store's own tests (test_store.py) cover both on every run."""
    return ["postgres"] if POSTGRES_URL else ["sqlite"]


def flotilla(
    *args: str, timeout: float = 60.0, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a user would."""
    proc = subprocess.run(
        [sys.executable, "-m", "flotilla", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=die_with_test,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"flotilla {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


@dataclass
class ServerProcess:
    state_dir: Path
    db_url: str | None = None
    port: int = 0
    extra: tuple[str, ...] = ("--liveness", "6")
    proc: subprocess.Popen[str] | None = None
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.state_dir.parent / f"{self.state_dir.name}-server.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        cmd = [
            sys.executable, "-m", "flotilla", "server",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--state-dir", str(self.state_dir), *self.extra,
        ]  # fmt: skip
        if self.db_url:
            cmd += ["--db", self.db_url]
        out = self.log.open("a")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=out, text=True, preexec_fn=die_with_test
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if match := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
                self.port = int(match.group(1))
                return
            if not line and self.proc.poll() is not None:
                break
        raise AssertionError(f"server did not start:\n{self.log.read_text()}")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def token(self) -> str:
        args = ["server", "token", "create", "--state-dir", str(self.state_dir)]
        if self.db_url:
            args += ["--db", self.db_url]
        return flotilla(*args).stdout.strip().splitlines()[-1]

    def operator(
        self, *args: str, timeout: float = 60.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return flotilla(
            *args, "--server", self.address, "--state-dir", str(self.state_dir),
            timeout=timeout, check=check,
        )  # fmt: skip

    def submit(self, spec: Path, *overrides: str) -> str:
        sets = [item for o in overrides for item in ("--set", o)]
        out = self.operator("job", "submit", str(spec), *sets).stdout
        return out.strip().splitlines()[-1]

    def status(self, job_id: str, rounds: bool = False) -> dict:
        args = ["job", "status", job_id, "--json"] + (["--rounds"] if rounds else [])
        return json.loads(self.operator(*args).stdout)

    def wait_for(
        self, job_id: str, timeout: float, states: tuple[str, ...] = ("completed",)
    ) -> dict:
        """Poll over one in-process operator connection (a CLI process per poll would take
        a core from the agents), then answer with what ``job status --json`` prints."""
        ended = (*states, "failed", "cancelled")
        state = asyncio.run(self._await_state(job_id, ended, timeout))
        if state not in ended:
            raise AssertionError(
                f"job {job_id} not done in {timeout}s: {state}\n{self.log.read_text()[-3000:]}"
            )
        return self.status(job_id)

    def wait_rounds(self, job_id: str, rounds: int, timeout: float) -> None:
        """Until the job has committed ``rounds`` rounds (in-process polls)."""

        async def committed(remote: Any) -> bool:
            return int((await remote.job(job_id)).rounds_committed) >= rounds

        if not asyncio.run(self._poll(committed, timeout)):
            raise AssertionError(f"job {job_id} did not commit {rounds} rounds in {timeout}s")

    def wait_devices(self, count: int, timeout: float, state: str = "idle") -> None:
        """Until ``count`` enrolled devices are in ``state`` (instead of sleeping on it)."""

        async def ready(remote: Any) -> bool:
            return sum(d.state == state for d in await remote.devices()) >= count

        if not asyncio.run(self._poll(ready, timeout)):
            raise AssertionError(f"{count} devices were not {state} within {timeout}s")

    async def _await_state(self, job_id: str, states: tuple[str, ...], timeout: float) -> str:
        last = [""]

        async def ended(remote: Any) -> bool:
            last[0] = (await remote.job(job_id)).state
            return last[0] in states

        await self._poll(ended, timeout)
        return last[0]

    async def _poll(self, done: Callable[[Any], Awaitable[bool]], timeout: float) -> bool:
        from flotilla.cli.remote import RemoteServer, operator_token

        token = operator_token(self.state_dir, None)
        deadline = time.monotonic() + timeout
        async with RemoteServer(self.address, token) as remote:
            while time.monotonic() < deadline:
                if await done(remote):
                    return True
                await asyncio.sleep(0.2)
        return False


@dataclass
class AgentFleet:
    server: ServerProcess
    token: str
    logs: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, count: int, task: str = DIGITS, extra: tuple[str, ...] = ()) -> None:
        for i in range(count):
            log = (self.logs / f"agent-{len(self.procs)}.log").open("ab")
            cmd = [
                sys.executable, "-m", "flotilla", "client",
                "--server", self.server.address, f"--token={self.token}",
                "--task", task, "--shard", f"{i}/{count}", *extra,
            ]  # fmt: skip
            self.procs.append(
                subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_test
                )
            )

    def alive(self) -> int:
        return sum(p.poll() is None for p in self.procs)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _wipe_postgres(url: str) -> None:

    from flotilla.server.federation.store import Store

    async def wipe() -> None:
        store = await Store.open(url)
        await store.wipe()
        await store.close()

    asyncio.run(wipe())


def database_url(param: str, tmp_path: Path) -> str:
    """The URL for one of ``database_params``: a fresh SQLite file, or the test PostgreSQL
    database (shared: :func:`open_empty_store` wipes it)."""
    if param == "sqlite":
        return f"sqlite:///{tmp_path / 'state' / 'flotilla.db'}"
    assert POSTGRES_URL is not None
    return POSTGRES_URL


async def open_empty_store(url: str) -> Store:
    from flotilla.server.federation.store import Store

    s = await Store.open(url)
    if s.dialect == "postgresql":
        await s.wipe()
    return s


@pytest.fixture(params=database_params())
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database URL for a :class:`Store`, once per database."""
    return database_url(request.param, tmp_path)


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[Store]:
    """An open, empty :class:`Store` on each database (see ``store_url``)."""
    s = await open_empty_store(store_url)
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture(params=server_database_params())
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str | None:
    """None means the server's default SQLite file in its state dir."""
    if request.param == "postgres":
        assert POSTGRES_URL is not None
        _wipe_postgres(POSTGRES_URL)
        return POSTGRES_URL
    return None


@pytest.fixture
def server(tmp_path: Path, db_url: str | None) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path / "state", db_url)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def sqlite_server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path / "state")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def fleet(server: ServerProcess, tmp_path: Path) -> Iterator[AgentFleet]:
    agents = AgentFleet(server, server.token(), tmp_path)
    yield agents
    agents.stop()


@pytest.fixture
def digits_spec() -> Path:
    return Path(__file__).resolve().parent.parent / "examples" / "digits.toml"
