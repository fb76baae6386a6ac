#!/usr/bin/env python
"""HTTP API benchmark: read latency on a loaded server, and what live dashboards cost.

A :class:`FederationServer` (gRPC and HTTP on free ports of 127.0.0.1) runs in this process
with 1,000 real agents enrolled through the in-process transport (each answers a round with
one canned update, so the numbers are about the platform) and at least 20 jobs: 17 finished
ones seeded into the store (one with 1,000 rounds, 300 with ``--quick``; the rest 10 each)
and the ones run here on the synthetic 100k-parameter task, 50 devices a round:

- a warm-up job, then jobs of 10 rounds alternately with no dashboard open and with 50
  dashboards subscribed to ``/api/v1/events`` (another process; each refetches what a
  change names, as the page does), 3 of each (2 with ``--quick``): the median round time
  of each kind, so that drift in a shared machine falls on both;
- a job running while another process reads, one request at a time: p50/p99 latency of
  the jobs list, the big job's rounds and the devices list.

Floors (reported, never an exit status): p99 of each read under 50 ms; 50 dashboards slow
rounds by under 5%. Stdout carries exactly one JSON object; a summary goes to stderr.

    python benchmarks/http_api.py --quick     # under 2 minutes
    python benchmarks/http_api.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from provenance import revision  # benchmarks/ is the script's sys.path[0]

from flotilla.client import Agent, AgentConfig
from flotilla.client.training import TrainOutcome, TrainWork
from flotilla.core.blobs import sha256_hex
from flotilla.core.device import DeviceProfile
from flotilla.core.records import JobRecord, ParticipationRecord, RoundAccount, RoundCommit
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import decode_state, encode_state
from flotilla.core.timeouts import Timeouts
from flotilla.engine import EngineConfig
from flotilla.inprocess import InProcessTransport
from flotilla.server.app import FederationServer, ServerConfig
from flotilla.server.federation import auth
from flotilla.server.federation.store import Store, default_url
from flotilla.server.federation.tokens import create_read_token

TASK = "flotilla.tasks.synthetic:Linear100K"
P99_LIMIT_MS = 50.0
SLOWDOWN_LIMIT = 0.05
DEVICES_PER_ROUND = 50
DASHBOARDS = 50
SEEDED_JOBS = 17


def _provenance() -> dict[str, Any]:
    return revision()


# --- agents --------------------------------------------------------------------------------


class CannedTrainer:
    """What the agent uses of ``LocalTrainer``: the same small update every time."""

    task_name = TASK

    def __init__(self) -> None:
        self.payload = b""

    def train(self, model_bytes: bytes | memoryview, work: TrainWork) -> TrainOutcome:
        if not self.payload:
            state = decode_state(model_bytes)
            self.payload = encode_state({k: v * 0 + 1e-4 for k, v in state.items()})
        return TrainOutcome(8, {"loss": 1.0}, self.payload, sha256_hex(self.payload))


class BenchAgent(Agent):
    """A real agent that skips what would dominate 1,000 of them on two cores: the matmul
    that measures its speed (a profile is given) and the hivemind identity."""

    def __init__(self, config: AgentConfig, index: int, server: FederationServer) -> None:
        transport = InProcessTransport(server.federation)
        super().__init__(config, rng=random.Random(index), transport=transport)
        self.index = index
        self.connected = False

    def _profile(self) -> DeviceProfile:
        gflops = [2.0, 40.0, 400.0][self.index % 3]  # one of each device class
        return DeviceProfile("", tasks=(TASK,), gflops=gflops, memory_bytes=2**32)

    def _p2p_identity(self) -> str:
        return ""

    async def _connect(self) -> None:
        await super()._connect()
        self.connected = True


# --- the store's history -------------------------------------------------------------------


async def seed(db_url: str, big: int, checkpoint: str) -> str:
    """Finished jobs with committed rounds, written as the engine commits them; the id of
    the one with ``big`` rounds."""
    store = await Store.open(db_url)
    try:
        await store.add_checkpoint(checkpoint, 1)
        spec = JobSpec.from_dict({"job": {"name": "seeded", "task": TASK}}, "bench").to_json()
        for j in range(SEEDED_JOBS):
            rounds = big if j == 0 else 10
            job = JobRecord.submitted(f"job-seed{j:02d}", f"seeded-{j}", spec, rounds,
                                      checkpoint, 1.0)  # fmt: skip
            await store.add_job(job)
            await store.set_job_state(job.id, "running")
            for r in range(1, rounds + 1):
                await store.commit_round(_round(job.id, r, checkpoint))
        return "job-seed00"
    finally:
        await store.close()


def _round(job_id: str, r: int, checkpoint: str) -> RoundCommit:
    devices = [f"dev-seed{(r * 7 + i) % 1000:04d}" for i in range(10)]
    parts = tuple(
        ParticipationRecord(job_id, r, d, 64, r, r + 0.5, {"loss": 1.0 / r, "bytes_up": 4e5})
        for d in devices
    )
    account = RoundAccount(
        selected=(*devices, "dev-late"),
        failures=(),
        stale=("dev-late",),
        bytes_up=4_000_000,
        bytes_down=4_000_000,
        decisions=("selected 11 of 900 idle by random", "closed at 10 of 11 (quorum 8)"),
    )
    return RoundCommit(job_id, r, checkpoint, {"accuracy": r / (r + 1), "loss": 1.0 / r},
                       float(r), r + 1.0, parts, account=account)  # fmt: skip


# --- measuring -----------------------------------------------------------------------------


async def run_job(server: FederationServer, name: str, rounds: int) -> list[float]:
    """Submit a job, wait for it; its round times (selection to commit), in seconds."""
    spec = JobSpec.from_dict(
        {"job": {"name": name, "task": TASK, "rounds": rounds,
                 "clients_per_round": DEVICES_PER_ROUND, "min_quorum": DEVICES_PER_ROUND,
                 "round_deadline_s": 120.0}},
        "bench",
    )  # fmt: skip
    job = await server.submit_job(spec.to_json())
    while (record := await server.store.get_job(job.id)) is not None and not record.terminal:
        await asyncio.sleep(0.2)
    assert record is not None and record.state == "completed", record
    return [r.committed_at - r.started_at for r in await server.store.list_rounds(job.id)]


async def run_watched(
    server: FederationServer, base: str, token: str, name: str, rounds: int
) -> list[float]:
    """:func:`run_job` while another process keeps ``DASHBOARDS`` pages open."""
    watchers = child("--dashboards", base, token, str(DASHBOARDS), "3600")
    try:
        assert watchers.stdout is not None
        await asyncio.to_thread(watchers.stdout.readline)  # "ready"
        await asyncio.sleep(1.0)  # every stream subscribed
        return await run_job(server, name, rounds)
    finally:
        watchers.terminate()
        await asyncio.to_thread(watchers.wait, 30)


def child(*args: str) -> subprocess.Popen[str]:
    """This script in another process (``--measure``, ``--dashboards``)."""
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), *args],
        stdout=subprocess.PIPE,
        text=True,
    )


async def measure(base: str, token: str, paths: list[str], count: int) -> dict[str, Any]:
    """One request at a time per path, ``count`` times each, after a warm-up."""
    headers = {"Authorization": f"Bearer {token}"}
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession(headers=headers) as http:
        for path in paths:
            samples = []
            for i in range(count + 5):
                started = time.perf_counter()
                async with http.get(base + path) as r:
                    await r.read()
                    assert r.status == 200, (path, r.status)
                if i >= 5:
                    samples.append((time.perf_counter() - started) * 1000)
            samples.sort()
            out[path] = {
                "p50_ms": samples[len(samples) // 2],
                "p99_ms": samples[min(len(samples) - 1, int(len(samples) * 0.99))],
                "max_ms": samples[-1],
                "requests": len(samples),
            }
    return out


async def dashboards(base: str, token: str, count: int, seconds: float) -> dict[str, Any]:
    """``count`` pages: each reads the event stream and refetches what a change names, as
    ``app.js`` does (the jobs list and the job's new rounds; the device table and its
    history, as the devices view does: every page here behaves as if it showed both)."""
    headers = {"Authorization": f"Bearer {token}"}
    fetched = [0]

    async def page(http: aiohttp.ClientSession) -> None:
        since: dict[str, int] = {}
        async with http.get(base + "/api/v1/events") as stream:
            async for line in stream.content:
                if not line.startswith(b"data: "):
                    continue
                change = json.loads(line[6:])
                if change["kind"] == "job":
                    job = change["job_id"]
                    for path in (
                        "/api/v1/jobs",
                        f"/api/v1/jobs/{job}/rounds?since={since.get(job, 0)}",
                    ):
                        async with http.get(base + path) as r:
                            body = await r.json()
                            fetched[0] += 1
                    if body.get("rounds"):
                        since[job] = body["rounds"][-1]["round"]
                elif change["kind"] == "devices":
                    for path in ("/api/v1/devices", "/api/v1/devices/history"):
                        async with http.get(base + path) as r:
                            await r.read()
                            fetched[0] += 1

    async with aiohttp.ClientSession(headers=headers) as http:
        pages = [asyncio.ensure_future(page(http)) for _ in range(count)]
        print("ready", flush=True)
        await asyncio.sleep(seconds)
        for p in pages:
            p.cancel()
        await asyncio.gather(*pages, return_exceptions=True)
    return {"pages": count, "refetches": fetched[0]}


async def start_fleet(server: FederationServer, count: int) -> list[asyncio.Task[None]]:
    token = auth.new_secret()
    await server.store.add_enrol_token(auth.hash_secret(token))
    timeouts = Timeouts(poll_s=40.0)
    config = AgentConfig(
        server="in-process",
        token=token,
        trainer=CannedTrainer(),  # type: ignore[arg-type]
        timeouts=timeouts,
        speed_test_bytes=16 * 1024,
    )
    agents = [BenchAgent(config, i, server) for i in range(count)]
    tasks = [asyncio.ensure_future(a.run()) for a in agents]
    deadline = time.monotonic() + 600
    while not all(a.connected for a in agents):
        if dead := [t for t in tasks if t.done()]:
            dead[0].result()
        assert time.monotonic() < deadline, "agents did not connect"
        await asyncio.sleep(0.2)
    while server.federation.device_counts()["idle"] < count:
        assert time.monotonic() < deadline, "agents did not poll"
        await asyncio.sleep(0.2)
    return tasks


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    state = work / "state"
    db_url = default_url(state)
    state.mkdir(parents=True)
    big_job = await seed(db_url, args.rounds_big, "0" * 64)
    config = ServerConfig(
        port=0,
        http_port=0,
        state_dir=state,
        timeouts=Timeouts(liveness_s=600.0, poll_hold_s=10.0),
        engine=EngineConfig(selection_grace_s=0.2),
    )
    server = FederationServer(config)
    await server.start()
    base = f"http://127.0.0.1:{server.http_port}"
    token = await create_read_token(state)
    fleet: list[asyncio.Task[None]] = []
    try:
        started = time.perf_counter()
        fleet = await start_fleet(server, args.agents)
        connect_s = time.perf_counter() - started
        await run_job(server, "warm-up", 3)  # first rounds pay for caches and imports
        alone: list[float] = []
        watched: list[float] = []
        for block in range(args.blocks):  # alternated, so drift in the machine hits both
            alone += await run_job(server, f"alone-{block}", args.rounds)
            watched += await run_watched(server, base, token, f"watched-{block}", args.rounds)
        paths = ["/api/v1/jobs", f"/api/v1/jobs/{big_job}/rounds", "/api/v1/devices"]
        reader = child("--measure", base, token, str(args.requests), *paths)
        busy = asyncio.ensure_future(run_job(server, "busy", args.busy_rounds))
        out, _ = await asyncio.to_thread(reader.communicate)
        latency = json.loads(out)
        await busy
        jobs = len(await server.store.list_jobs())
    finally:
        for task in fleet:
            task.cancel()
        await asyncio.gather(*fleet, return_exceptions=True)
        await server.stop(grace_s=0.5)
    return report(args, connect_s, alone, watched, latency, jobs)


def report(
    args: argparse.Namespace,
    connect_s: float,
    alone: list[float],
    watched: list[float],
    latency: dict[str, Any],
    jobs: int,
) -> dict[str, Any]:
    floors = []

    def floor(name: str, value: float, limit: float) -> None:
        floors.append({"name": name, "value": value, "limit": limit, "ok": value < limit})

    for path, numbers in latency.items():
        floor(f"p99 GET {path} (ms)", numbers["p99_ms"], P99_LIMIT_MS)
    slowdown = statistics.median(watched) / statistics.median(alone) - 1.0
    floor(f"round time slowdown with {DASHBOARDS} dashboards", slowdown, SLOWDOWN_LIMIT)
    return {
        "benchmark": "http",
        "mode": "quick" if args.quick else "full",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "aiohttp": aiohttp.__version__,
            "platform": platform.platform(),
            "load_average_1m": os.getloadavg()[0],
        },
        "revision": _provenance(),
        "agents": args.agents,
        "jobs": jobs,
        "big_job_rounds": args.rounds_big,
        "connect_seconds": connect_s,
        "latency": latency,
        "round_seconds": {"alone": alone, f"with_{DASHBOARDS}_dashboards": watched},
        "median_round_seconds": {
            "alone": statistics.median(alone),
            f"with_{DASHBOARDS}_dashboards": statistics.median(watched),
        },
        "floors": floors,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and requests")
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--keep", action="store_true", help="keep the state directory")
    parser.add_argument("--measure", nargs="+", metavar="ARG", help=argparse.SUPPRESS)
    parser.add_argument("--dashboards", nargs=4, metavar="ARG", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:  # a child: BASE TOKEN COUNT PATH...
        base, token, count, *paths = args.measure
        print(json.dumps(asyncio.run(measure(base, token, paths, int(count)))))
        return 0
    if args.dashboards:  # a child: BASE TOKEN PAGES SECONDS
        base, token, pages, seconds = args.dashboards
        print(json.dumps(asyncio.run(dashboards(base, token, int(pages), float(seconds)))))
        return 0
    args.rounds = 10  # per block; blocks of jobs alone and watched alternate
    args.blocks = 2 if args.quick else 3
    args.busy_rounds = 20 if args.quick else 60  # runs while the reads are timed
    args.rounds_big = 300 if args.quick else 1000
    args.requests = 100 if args.quick else 400
    work = Path(tempfile.mkdtemp(prefix="flotilla-bench-http-"))
    try:
        result = asyncio.run(run(args, work))
    finally:
        if not args.keep:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))
    ok = sum(f["ok"] for f in result["floors"])
    lines = [f"{f['name']}: {f['value']:.3f} (limit {f['limit']})" for f in result["floors"]]
    print(f"http: floors {ok}/{len(result['floors'])} ok; " + "; ".join(lines), file=sys.stderr)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
