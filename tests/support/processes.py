"""Real processes on 127.0.0.1: a ``flotilla server``, ``flotilla client`` agents, the CLI.

For the tests where processes are the point (kill -9, Ctrl-C, TLS, the CLI itself); the
rest run a federation in one process (:mod:`tests.support.inproc`).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.lifetime import bound

DIGITS = "flotilla.tasks.digits:DigitsTask"


def flotilla(
    *args: str, timeout: float = 60.0, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a user would."""
    proc = subprocess.run(
        bound([sys.executable, "-m", "flotilla", *args]),
        capture_output=True,
        text=True,
        timeout=timeout,
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
    #: The HTTP edge's port, read from the server's ``dashboard:`` line (always a free one).
    http_port: int = 0
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
            "--host", "127.0.0.1", "--port", str(self.port), "--http-port", "0",
            "--state-dir", str(self.state_dir), *self.extra,
        ]  # fmt: skip
        if self.db_url:
            cmd += ["--db", self.db_url]
        out = self.log.open("a")
        self.proc = subprocess.Popen(bound(cmd), stdout=subprocess.PIPE, stderr=out, text=True)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if found := re.search(r"dashboard: https?://127\.0\.0\.1:(\d+)/", line):
                self.http_port = int(found.group(1))
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

    def start(
        self, count: int, task: str = DIGITS, extra: tuple[str, ...] = (), of: int | None = None
    ) -> None:
        """``count`` agents on shards ``0..count-1`` of ``of`` (default ``count``); their
        temporary files go to the test process's own (``private_tmpdir`` in conftest)."""
        for i in range(count):
            log = (self.logs / f"agent-{len(self.procs)}.log").open("ab")
            cmd = [
                sys.executable, "-m", "flotilla", "client",
                "--server", self.server.address, f"--token={self.token}",
                "--task", task, "--shard", f"{i}/{of or count}", *extra,
            ]  # fmt: skip
            self.procs.append(subprocess.Popen(bound(cmd), stdout=log, stderr=subprocess.STDOUT))

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


def terminate_all(procs: list[subprocess.Popen[str]], wait_s: float = 20.0) -> None:
    """SIGTERM every process, then wait for each, killing what outlives ``wait_s``."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(wait_s)
        except subprocess.TimeoutExpired:
            p.kill()
