"""``flotilla demo``: a real local federation a newcomer can watch train.

A federation server with its SQLite database runs in this process; the agents are separate
``flotilla client`` processes, each with its own non-IID shard of the digits; several jobs
train at once. Everything listens on 127.0.0.1 and goes away at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from flotilla.core.spec import JobSpec

if TYPE_CHECKING:
    from flotilla.server.app import ServerConfig
    from flotilla.server.federation.store import Store

DIGITS_TASK = "flotilla.tasks.digits:DigitsTask"


def example_spec_path() -> Path:
    return Path(str(resources.files("flotilla") / "examples" / "digits.toml"))


def start_agents(port: int, token: str, count: int, logs: Path) -> list[subprocess.Popen[bytes]]:
    # Eight agents share this machine's cores: one math thread each keeps torch's thread
    # pools from fighting over them (a real device runs one agent and keeps its default).
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    procs = []
    for i in range(count):
        log = (logs / f"agent-{i}.log").open("wb")
        cmd = [
            sys.executable,
            "-m",
            "flotilla",
            "client",
            "--server",
            f"127.0.0.1:{port}",
            "--token",
            token,
            "--task",
            DIGITS_TASK,
            "--shard",
            f"{i}/{count}",
        ]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    return procs


def stop_agents(procs: list[subprocess.Popen[bytes]], stop_s: float) -> None:
    """SIGINT every agent; kill those still running ``stop_s`` later."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + stop_s
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass(frozen=True, slots=True)
class DemoJob:
    """How one of the demo's jobs went (``--json`` prints these)."""

    id: str
    name: str
    state: str
    #: Held-out accuracy after each committed round.
    accuracy: list[float | None]
    #: The devices of each committed round.
    participants: list[list[str]]


def demo_server_config(state_dir: Path) -> ServerConfig:
    """The demo's server: every port it listens on picked free (never a fixed default), so
    a demo runs beside a real server and beside another demo. The one place that says how
    the demo's server is configured."""
    from flotilla.server.app import ServerConfig

    return ServerConfig(port=0, state_dir=state_dir, http_port=0)


def dashboard_url(state_dir: Path) -> str | None:
    """The dashboard's address from the server's ``server.json``; None when the server
    serves no HTTP (no ``http_port``, or null)."""
    from flotilla.server.app import STATE_FILE

    try:
        state = json.loads((state_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    port = state.get("http_port")
    if not isinstance(port, int):
        return None
    host = str(state.get("http_host") or state.get("host") or "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/"


@dataclass(frozen=True, slots=True)
class Served:
    """Where the demo's server was: what the closing lines point the user to."""

    port: int
    state_dir: Path
    dashboard: str | None

    @property
    def dashboard_line(self) -> str:
        """The dashboard's address, and where the token it asks for is."""
        return f"dashboard: {self.dashboard} (token: {self.state_dir / 'operator.token'})"


async def _federate(options: DemoOptions, state: Path) -> list[DemoJob]:
    from flotilla.server.app import FederationServer
    from flotilla.server.federation import auth
    from flotilla.server.process import single_threaded_blas

    single_threaded_blas()  # this process is the demo's server
    server = FederationServer(demo_server_config(state))
    port = await server.start()
    served = Served(port, state, dashboard_url(state))
    if served.dashboard and not options.as_json:
        print(served.dashboard_line, flush=True)
    token = auth.new_secret()
    await server.store.add_enrol_token(auth.hash_secret(token))
    procs = start_agents(port, token, options.agents, state)
    try:
        ids = [(await server.submit_job(spec.to_json())).id for spec in demo_specs(options)]
        await _follow(server.store, ids, progress=not options.as_json)
        results = [await _summary(server.store, job_id) for job_id in ids]
        if options.keep_serving:
            await _until_interrupted(lambda: report(results, options, served))
    finally:
        await asyncio.to_thread(stop_agents, procs, server.config.timeouts.child_stop_s)
        await server.stop()
    if not options.keep_serving:  # last, below the lines of the agents leaving
        report(results, options, served)
    return results


def demo_specs(options: DemoOptions) -> list[JobSpec]:
    """The demo's jobs: the digits example, named digits-a, digits-b, ..., seeded apart."""
    base = JobSpec.load(example_spec_path(), [f"job.rounds={options.rounds}"]).to_dict()
    return [
        JobSpec.from_dict({**base, "job": {**base["job"], "name": _name(j), "seed": j}})
        for j in range(options.jobs)
    ]


def _name(j: int) -> str:
    return f"digits-{chr(97 + j)}"


async def _follow(store: Store, ids: list[str], progress: bool) -> None:
    """Until every job has ended: a bar per job (a line per round where stderr is no
    terminal)."""
    from flotilla.report import JobBars

    totals = {}
    for job_id in ids:
        job = await store.get_job(job_id)
        assert job is not None, job_id
        totals[job.name] = job.rounds_total
    with JobBars(totals, bars=None if progress else False) as bars:
        while True:
            jobs = [await store.get_job(job_id) for job_id in ids]
            for job in jobs:
                assert job is not None
                accuracy = job.metrics.get("accuracy")
                notes = {"accuracy": f"{accuracy:.3f}"} if accuracy is not None else {}
                if progress:
                    bars.update(job.name, job.rounds_committed, **notes)
            if all(job is not None and job.terminal for job in jobs):
                return
            await asyncio.sleep(0.5)


async def _until_interrupted(announce: Callable[[], None]) -> None:
    """Until Ctrl-C (or SIGTERM): the normal end of ``--keep-serving``, not an error.
    ``announce`` tells the user so, once a Ctrl-C would be caught."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        announce()
        await stop.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


async def _summary(store: Store, job_id: str) -> DemoJob:
    job = await store.get_job(job_id)
    assert job is not None, job_id
    rounds = await store.list_rounds(job_id)
    return DemoJob(
        id=job.id,
        name=job.name,
        state=job.state,
        accuracy=[r.metrics.get("accuracy") for r in rounds],
        participants=[[p.device_id for p in r.participants] for r in rounds],
    )


def _cell(accuracy: float | None) -> str:
    return f"{accuracy:>10.4f}" if accuracy is not None else f"{'-':>10}"


def print_table(results: list[DemoJob]) -> None:
    names = [r.name for r in results]
    print("\nheld-out accuracy per round")
    print("round " + " ".join(f"{n:>10}" for n in names))
    for i in range(max(len(r.accuracy) for r in results)):
        cells = []
        for r in results:
            acc = r.accuracy[i] if i < len(r.accuracy) else None
            cells.append(_cell(acc))
        print(f"{i + 1:>5} " + " ".join(cells))
    print("final " + " ".join(_cell(r.accuracy[-1] if r.accuracy else None) for r in results))


def report(results: list[DemoJob], options: DemoOptions, served: Served) -> None:
    """The demo's last words: its table, the dashboard and what to try next (``--json``:
    the results as JSON, nothing else)."""
    if options.as_json:
        jobs_json = [dataclasses.asdict(r) for r in results]
        print(json.dumps({"jobs": jobs_json, "seconds": time.monotonic() - options.started}))
        return
    print_table(results)
    print(f"done in {time.monotonic() - options.started:.1f}s")
    print(next_steps(results, options.keep_serving, served), flush=True)


def next_steps(results: list[DemoJob], keep_serving: bool, served: Served) -> str:
    """Where to go from here; with ``--keep-serving``, commands for this very server."""
    job = results[0].id if results else "JOB_ID"
    where = f"--server 127.0.0.1:{served.port} --state-dir {served.state_dir}"
    lines = []
    if keep_serving:
        if served.dashboard:
            lines.append(served.dashboard_line)
        lines.append(f"serving on 127.0.0.1:{served.port} until Ctrl-C. Meanwhile, try:")
    else:
        lines.append("what to try next:")
        lines.append("  flotilla demo --keep-serving       # keep the server up to look around")
        job, where = "JOB_ID", "--server HOST:PORT --state-dir STATE"
    lines += [
        f"  flotilla job status {job} --watch {where}",
        f"  flotilla job plot {job} --out plots {where}",
        "  flotilla simulate examples/digits-sim.toml --out sim-out && flotilla dashboard sim-out",
        "  docs: docs/cli.md (every command), docs/simulation.md, docs/federation.md",
    ]
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """What ``flotilla demo`` was asked for."""

    agents: int
    rounds: int
    jobs: int
    as_json: bool = False
    keep_serving: bool = False
    #: ``time.monotonic()`` at the start, for "done in".
    started: float = 0.0


def run_demo(
    agents: int,
    rounds: int,
    jobs: int,
    state_dir: Path | None,
    as_json: bool,
    keep_serving: bool = False,
) -> int:
    options = DemoOptions(agents, rounds, jobs, as_json, keep_serving, time.monotonic())
    with contextlib.ExitStack() as stack:
        if state_dir is None:
            state_dir = Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="flotilla-demo-"))
            )
        if not as_json:
            print(f"flotilla demo: server + {agents} agents, {jobs} jobs x {rounds} rounds")
            print(f"state in {state_dir}", flush=True)
        results = asyncio.run(_federate(options, state_dir))
    return 0 if all(r.state == "completed" for r in results) else 1
