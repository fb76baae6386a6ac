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
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from flotilla.core.spec import JobSpec

if TYPE_CHECKING:
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


async def _federate(state: Path, agents: int, rounds: int, jobs: int, quiet: bool) -> list[DemoJob]:
    from tqdm import tqdm

    from flotilla.server.app import FederationServer, ServerConfig
    from flotilla.server.federation import auth
    from flotilla.server.process import single_threaded_blas

    single_threaded_blas()  # this process is the demo's server
    server = FederationServer(ServerConfig(port=0, state_dir=state, http_port=0))
    port = await server.start()
    token = auth.new_secret()
    await server.store.add_enrol_token(auth.hash_secret(token))
    procs = start_agents(port, token, agents, state)
    try:
        base = JobSpec.load(example_spec_path(), [f"job.rounds={rounds}"])
        ids = []
        for j in range(jobs):
            spec = JobSpec.from_dict(
                {
                    **base.to_dict(),
                    "job": {**base.to_dict()["job"], "name": f"digits-{chr(97 + j)}", "seed": j},
                }
            )
            ids.append((await server.submit_job(spec.to_json())).id)
        bars = [
            tqdm(
                total=rounds, desc=f"digits-{chr(97 + j)}", position=j, disable=quiet, unit="round"
            )
            for j in range(jobs)
        ]
        while True:
            done = 0
            for bar, job_id in zip(bars, ids, strict=True):
                job = await server.store.get_job(job_id)
                assert job is not None
                bar.n = job.rounds_committed
                if "accuracy" in job.metrics:
                    bar.set_postfix(accuracy=f"{job.metrics['accuracy']:.3f}")
                bar.refresh()
                done += job.terminal
            if done == len(ids):
                break
            await asyncio.sleep(0.5)
        for bar in bars:
            bar.close()
        return [await _summary(server.store, job_id) for job_id in ids]
    finally:
        await asyncio.to_thread(stop_agents, procs, server.config.timeouts.child_stop_s)
        await server.stop()


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


def run_demo(agents: int, rounds: int, jobs: int, state_dir: Path | None, as_json: bool) -> int:
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if state_dir is None:
            state_dir = Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="flotilla-demo-"))
            )
        print(f"flotilla demo: server + {agents} agents, {jobs} jobs x {rounds} rounds")
        print(f"state in {state_dir}")
        results = asyncio.run(_federate(state_dir, agents, rounds, jobs, quiet=as_json))
    if as_json:
        jobs_json = [dataclasses.asdict(r) for r in results]
        print(json.dumps({"jobs": jobs_json, "seconds": time.monotonic() - started}))
    else:
        print_table(results)
        print(f"done in {time.monotonic() - started:.1f}s")
    return 0 if all(r.state == "completed" for r in results) else 1
