#!/usr/bin/env python
"""Edge benchmark: 1,000 light devices polling one server, over HTTP and over gRPC.

One ``flotilla server`` runs as a subprocess (``--poll-hold 2``, ``--liveness 600``) so
its CPU time (user + system, all threads) is measured alone; the devices are asyncio tasks
in this process (``edge_devices.py``: aiohttp for the HTTP device protocol, a grpc.aio
channel each for the gRPC edge), doing no training. For each edge, in the same run:

- **poll**: 1,000 enrolled devices long-poll with no work anywhere; each starts at a random
  moment within one hold and re-polls at once, as the protocol says. Latency of each
  answered poll, its excess over the hold (the server's overhead: queueing, auth, JSON or
  protobuf), and the server's CPU per poll, over a window after a warm-up.
- **upload**: the other devices leave; 100 of them run jobs on the synthetic
  100k-parameter task (every device every round): poll, download the model, wait for the
  round's other downloads (so a round's uploads run together), upload one update (HTTP:
  create, PUT chunks, finalize; gRPC: ReserveUpload, SubmitUpdate), signed as a real
  device signs it: every device enrols with an Ed25519 public key and signs each upload
  with a fresh nonce (``docs/identity.md``). Server CPU per accepted update from
  submission to completion (its signature check included; the job's own work, evaluation
  and checkpoints included, is the same on both edges), update MB/s while a round's uploads
  run, and the accepted updates counted against the committed rounds. Chunks are 1 MiB,
  what the HTTP edge advises (one chunk per update); full runs upload again in 64 KiB
  chunks. Full runs do two jobs per edge, the edges alternating, so drift in a shared
  machine hits both.

Floors (reported, never an exit status): HTTP poll p99 overhead under 250 ms at 1,000
devices; the HTTP edge's server CPU per accepted update within 2x the gRPC edge's.
Stdout carries exactly one JSON object; a summary goes to stderr.

    python benchmarks/edge.py --quick     # under 2 minutes on 2 cores
    python benchmarks/edge.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from edge_devices import Fleet, GrpcFleet, HttpFleet, SharedUpdate
from federation import CpuClock, Process, flotilla_cli
from provenance import revision

from flotilla.cli.remote import RemoteServer
from flotilla.core.device import DeviceProfile
from flotilla.core.spec import JobSpec
from flotilla.core.work import DeviceCredential, RoundRef

TASK = "flotilla.tasks.synthetic:Linear100K"
P99_OVERHEAD_LIMIT_MS = 250.0
CPU_RATIO_LIMIT = 2.0
#: Devices enrolling (and leaving) at once: a fleet's first contact is not the measurement.
ENROL_CONCURRENCY = 64
JOB_TIMEOUT_S = 600.0
#: Full runs upload again in chunks this size: a phone on a flaky link sends small ones.
SMALL_CHUNK_BYTES = 64 * 1024
#: A device waits at most this long for the rest of its round before it uploads anyway.
LINE_UP_S = 30.0
FAILURES = (RuntimeError, aiohttp.ClientError, grpc.aio.AioRpcError, asyncio.TimeoutError)


@dataclass(frozen=True)
class Plan:
    devices: int
    hold_s: float
    window_s: float
    uploaders: int
    rounds: int
    blocks: int
    chunk_bytes: int
    #: A second set of upload jobs with this chunk size (0: none).
    small_chunk_bytes: int


@dataclass
class Tally:
    """What one phase's devices saw; appended to by every device task (one event loop)."""

    polls: list[float] = field(default_factory=list)  # seconds, empty answers in the window
    window: tuple[float, float] = (float("inf"), 0.0)  # none until a window is set
    offers: list[tuple[str, int, float]] = field(default_factory=list)  # job, round, unix time
    uploads: list[tuple[str, int, float, float, int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: Devices per round: each round's uploads wait for all of its downloads, so they run
    #: together and the round's upload rate is the edge's, not the download queue's.
    together: int = 0
    _lined: dict[tuple[str, int], int] = field(default_factory=dict)
    _go: dict[tuple[str, int], asyncio.Event] = field(default_factory=dict)

    async def line_up(self, ref: RoundRef) -> None:
        key = (ref.job_id, ref.round)
        go = self._go.setdefault(key, asyncio.Event())
        self._lined[key] = self._lined.get(key, 0) + 1
        if self._lined[key] >= self.together:
            go.set()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(go.wait(), LINE_UP_S)

    def empty_poll(self, began: float, ended: float) -> None:
        if self.window[0] <= began and ended <= self.window[1]:
            self.polls.append(ended - began)


async def device(
    fleet: Fleet,
    me: DeviceCredential,
    stop: asyncio.Event,
    tally: Tally,
    work: SharedUpdate,
    chunk: int,
) -> None:
    """A device's loop: poll; with a task, fetch the model and upload the shared update."""
    while not stop.is_set():
        began = time.perf_counter()
        try:
            offer = await fleet.poll(me)
            if offer is None:
                tally.empty_poll(began, time.perf_counter())
                continue
            tally.offers.append((offer.ref.job_id, offer.ref.round, time.time()))
            update = work.of(await fleet.fetch(me, offer))
            await tally.line_up(offer.ref)
            sent = time.perf_counter()
            await fleet.upload(me, offer, update, work.sha256, chunk)
            ref = offer.ref
            tally.uploads.append((ref.job_id, ref.round, sent, time.perf_counter(), len(update)))
        except FAILURES as exc:
            tally.errors.append(f"{type(exc).__name__}: {exc}"[:300])
            await asyncio.sleep(0.5)


async def run_fleet(
    fleet: Fleet,
    devices: list[DeviceCredential],
    tally: Tally,
    work: SharedUpdate,
    stagger_s: float,
    chunk: int = 0,
) -> tuple[asyncio.Event, list[asyncio.Task[None]]]:
    """Every device's loop, each started at a random moment within ``stagger_s``."""
    stop = asyncio.Event()

    async def one(me: DeviceCredential) -> None:
        await asyncio.sleep(random.uniform(0.0, stagger_s))
        await device(fleet, me, stop, tally, work, chunk)

    return stop, [asyncio.ensure_future(one(d)) for d in devices]


async def halt(stop: asyncio.Event, tasks: list[asyncio.Task[None]], hold_s: float) -> None:
    """Let each device finish its held poll, then cancel what is left."""
    stop.set()
    _, pending = await asyncio.wait(tasks, timeout=hold_s + 10.0)
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def each(count: int, call: Any) -> list[Any]:
    """``call(i)`` for i < count, ``ENROL_CONCURRENCY`` at a time."""
    gate = asyncio.Semaphore(ENROL_CONCURRENCY)

    async def one(i: int) -> Any:
        async with gate:
            return await call(i)

    return list(await asyncio.gather(*(one(i) for i in range(count))))


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


def spread_ms(samples_s: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in samples_s]
    return {
        "min": min(ms, default=float("nan")),
        "p50": pct(ms, 0.5),
        "p99": pct(ms, 0.99),
        "max": max(ms, default=float("nan")),
    }


# --- phases ----------------------------------------------------------------------------------


async def poll_phase(
    fleet: Fleet, devices: list[DeviceCredential], plan: Plan, server_pid: int
) -> dict[str, Any]:
    tally = Tally()
    stop, tasks = await run_fleet(fleet, devices, tally, SharedUpdate(), plan.hold_s)
    try:
        await asyncio.sleep(2 * plan.hold_s + 1.0)  # every device started and settled
        start = time.perf_counter()
        tally.window = (start, start + plan.window_s)
        cpu = CpuClock(server_pid)
        await asyncio.sleep(plan.window_s)
        server_cpu, client_cpu = cpu.elapsed()
    finally:
        await halt(stop, tasks, plan.hold_s)
    await each(len(devices), lambda i: fleet.leave(devices[i]))
    polls = len(tally.polls)
    return {
        "devices": len(devices),
        "window_s": plan.window_s,
        "polls": polls,
        "polls_per_s": polls / plan.window_s,
        "latency_ms": spread_ms(tally.polls),
        "over_hold_ms": spread_ms([max(0.0, s - plan.hold_s) for s in tally.polls]),
        "server_cpu_s": server_cpu,
        "server_cpu_ms_per_poll": 1000 * server_cpu / max(1, polls),
        "server_cpu_share": server_cpu / plan.window_s,
        "client_cpu_s": client_cpu,
        "client_cpu_share": client_cpu / plan.window_s,
        "offers": len(tally.offers),
        "errors": len(tally.errors),
        "first_errors": tally.errors[:3],
    }


async def upload_job(
    fleet: Fleet,
    devices: list[DeviceCredential],
    plan: Plan,
    server: tuple[str, str, int],
    rounds: int,
    chunk: int,
) -> dict[str, Any]:
    """One job on ``devices`` (all of them every round), its devices polling only meanwhile."""
    address, operator, pid = server
    tally, work = Tally(together=len(devices)), SharedUpdate()
    stop, tasks = await run_fleet(fleet, devices, tally, work, 0.0, chunk)
    spec = JobSpec.from_dict(
        {"job": {"name": f"edge-{fleet.edge}", "task": TASK, "rounds": rounds,
                 "clients_per_round": len(devices), "min_quorum": len(devices),
                 "round_deadline_s": 120.0}},
        "benchmark",
    )  # fmt: skip
    try:
        await asyncio.sleep(1.0)  # every device in a held poll
        async with RemoteServer(address, operator) as remote:
            began = time.perf_counter()
            cpu = CpuClock(pid)
            info = await remote.submit(spec)
            deadline = time.monotonic() + JOB_TIMEOUT_S
            while info.state not in ("completed", "failed", "cancelled"):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {info.id} not done after {JOB_TIMEOUT_S:.0f}s")
                await asyncio.sleep(0.1)
                info = await remote.job(info.id)
            server_cpu, client_cpu = cpu.elapsed()
            wall = time.perf_counter() - began
            info = await remote.job(info.id, with_rounds=True)
    finally:
        await halt(stop, tasks, plan.hold_s)
        await each(len(devices), lambda i: fleet.leave(devices[i]))
    if info.state != "completed":
        raise RuntimeError(f"{fleet.edge} job {info.id} ended {info.state}: {tally.errors[:3]}")
    return {"info": info, "tally": tally, "server_cpu": server_cpu, "client_cpu": client_cpu,
            "wall": wall, "model_bytes": 0}  # fmt: skip


def upload_numbers(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """One edge's measured jobs together."""
    uploads = [u for j in jobs for u in j["tally"].uploads]
    accepted = len(uploads)
    committed = sum(len(r.participants) for j in jobs for r in j["info"].rounds)
    server_cpu = sum(j["server_cpu"] for j in jobs)
    per_round: dict[tuple[str, int], list[tuple[float, float, int]]] = {}
    for job_id, rnd, start, end, size in uploads:
        per_round.setdefault((job_id, rnd), []).append((start, end, size))
    rates = [
        sum(u[2] for u in us) / 1e6 / (max(u[1] for u in us) - min(u[0] for u in us))
        for us in per_round.values()
    ]
    started = {(j["info"].id, r.round): r.started_at for j in jobs for r in j["info"].rounds}
    delivery = [
        t - started[(job, rnd)] for j in jobs for job, rnd, t in j["tally"].offers
        if (job, rnd) in started
    ]  # fmt: skip
    update_mb = sum(u[4] for u in uploads) / 1e6
    return {
        "jobs": len(jobs),
        "rounds": sum(len(j["info"].rounds) for j in jobs),
        "devices_per_round": len(uploads) // max(1, len(per_round)),
        "accepted": accepted,
        "committed_updates": committed,
        "update_mb": update_mb,
        "job_seconds": sum(j["wall"] for j in jobs),
        "server_cpu_s": server_cpu,
        "server_cpu_ms_per_update": 1000 * server_cpu / max(1, accepted),
        "client_cpu_s": sum(j["client_cpu"] for j in jobs),
        "upload_mb_s": statistics.median(rates) if rates else float("nan"),
        "overall_mb_s": update_mb / max(1e-9, sum(j["wall"] for j in jobs)),
        "upload_ms": spread_ms([u[3] - u[2] for u in uploads]),
        "delivery_ms": spread_ms(delivery),
        "errors": sum(len(j["tally"].errors) for j in jobs),
        "first_errors": [e for j in jobs for e in j["tally"].errors][:3],
    }


# --- the run ---------------------------------------------------------------------------------


def start_server(work: Path, hold_s: float) -> tuple[Process, str, str]:
    """``flotilla server`` with both edges on free ports; (process, HTTP base, operator)."""
    state = work / "state"
    server = Process(
        [sys.executable, "-m", "flotilla", "server", "--host", "127.0.0.1", "--port", "0",
         "--http-port", "0", "--state-dir", str(state), "--liveness", "600",
         "--poll-hold", str(hold_s),
         # 1,000 devices on one loopback address: no per-address caps or enrol limit here.
         "--rate-limit", "enrol=100000/100000", "--max-connections", "100000"],
        work / "server.log",
    )  # fmt: skip
    server.start()
    out = (work / "server.out").read_text()
    base = next(line.split()[-1] for line in out.splitlines() if line.startswith("dashboard:"))
    return server, base.rstrip("/"), (state / "operator.token").read_text().strip()


async def upload_blocks(
    fleets: dict[str, Fleet],
    devices: dict[str, list[DeviceCredential]],
    plan: Plan,
    target: tuple[str, str, int],
    chunk: int,
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """``plan.blocks`` jobs per edge, the edges alternating; each edge's numbers."""
    jobs: dict[str, list[dict[str, Any]]] = {edge: [] for edge in fleets}
    for _ in range(plan.blocks):
        for edge, fleet in fleets.items():
            uploaders = devices[edge][: plan.uploaders]
            jobs[edge].append(await upload_job(fleet, uploaders, plan, target, plan.rounds, chunk))
            cpu = jobs[edge][-1]["server_cpu"]
            progress(f"upload {edge}, chunks {chunk or 'as advised'}: {cpu:.2f} s server CPU")
    return {edge: upload_numbers(js) for edge, js in jobs.items()}, jobs


async def run(plan: Plan, work: Path) -> dict[str, Any]:
    server, base, operator = start_server(work, plan.hold_s)
    state = str(work / "state")
    token = flotilla_cli("server", "token", "create", "--state-dir", state).strip().split()[-1]
    fleets: dict[str, Fleet] = {
        "http": HttpFleet(base, plan.hold_s),
        "grpc": GrpcFleet(server.address, plan.hold_s),
    }
    profile = DeviceProfile("", tasks=(TASK,), gflops=2.0, device_class="phone")
    out: dict[str, Any] = {"enrol_s": {}, "poll": {}, "upload": {}}
    try:
        devices: dict[str, list[DeviceCredential]] = {}
        for edge, fleet in fleets.items():
            began = time.perf_counter()
            devices[edge] = await each(plan.devices, lambda _, f=fleet: f.enrol(token, profile))
            out["enrol_s"][edge] = time.perf_counter() - began
        for edge, fleet in fleets.items():
            out["poll"][edge] = await poll_phase(fleet, devices[edge], plan, server.pid)
            progress(f"poll {edge}: {out['poll'][edge]['over_hold_ms']}")
        target = (server.address, operator, server.pid)
        for edge, fleet in fleets.items():  # the first job imports torch; rounds warm caches
            await upload_job(fleet, devices[edge][: plan.uploaders], plan, target, 1, 0)
        out["upload"], jobs = await upload_blocks(fleets, devices, plan, target, plan.chunk_bytes)
        if plan.small_chunk_bytes:
            small, _ = await upload_blocks(fleets, devices, plan, target, plan.small_chunk_bytes)
            out["upload_small_chunks"] = {"chunk_bytes": plan.small_chunk_bytes, **small}
        out["update_bytes"] = jobs["http"][0]["tally"].uploads[0][4]
    finally:
        for fleet in fleets.values():
            await fleet.aclose()
        server.stop()
    return out


def progress(line: str) -> None:
    print(f"edge: {line}", file=sys.stderr, flush=True)


def ratios(poll: dict[str, Any] | None, upload: dict[str, Any]) -> dict[str, float]:
    """HTTP over gRPC: above 1, the HTTP edge costs more (or, for MB/s, moves more)."""

    def ratio(edges: dict[str, Any], key: str) -> float:
        return float(edges["http"][key] / edges["grpc"][key])

    out = {"server_cpu_per_poll": ratio(poll, "server_cpu_ms_per_poll")} if poll else {}
    out["server_cpu_per_update"] = ratio(upload, "server_cpu_ms_per_update")
    out["upload_mb_s"] = ratio(upload, "upload_mb_s")
    return out


def report(plan: Plan, quick: bool, measured: dict[str, Any], load: float) -> dict[str, Any]:
    poll, upload = measured["poll"], measured["upload"]
    overhead_p99 = poll["http"]["over_hold_ms"]["p99"]
    cpu_ratio = ratios(None, upload)["server_cpu_per_update"]
    floors = [
        {"name": f"HTTP poll p99 over the hold at {plan.devices} devices (ms)",
         "value": overhead_p99, "limit": P99_OVERHEAD_LIMIT_MS,
         "ok": overhead_p99 < P99_OVERHEAD_LIMIT_MS},
        {"name": "server CPU per accepted update, HTTP / gRPC", "value": cpu_ratio,
         "limit": CPU_RATIO_LIMIT, "ok": cpu_ratio <= CPU_RATIO_LIMIT},
    ]  # fmt: skip
    result = {
        "benchmark": "edge",
        "mode": "quick" if quick else "full",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "aiohttp": aiohttp.__version__,
            "grpcio": grpc.__version__,
            "platform": platform.platform(),
            "load_average_1m_before": load,
            "load_average_1m_after": os.getloadavg()[0],
        },
        "revision": revision(),
        "plan": {**plan.__dict__, "task": TASK},
        "update_bytes": measured["update_bytes"],
        "enrol_seconds": measured["enrol_s"],
        "poll": poll,
        "upload": upload,
        "ratios_http_over_grpc": ratios(poll, upload),
    }
    if small := measured.get("upload_small_chunks"):
        result["upload_small_chunks"] = {**small, "ratios_http_over_grpc": ratios(None, small)}
    result["floors"] = floors
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter windows, fewer rounds")
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--hold", type=float, default=2.0, help="server poll hold, seconds")
    parser.add_argument("--uploaders", type=int, default=100, help="devices per upload round")
    parser.add_argument(
        "--chunk-bytes", type=int, default=0, help="upload chunks (0: as the edge advises, 1 MiB)"
    )
    parser.add_argument(
        "--small-chunk-bytes", type=int, default=None,
        help="the upload jobs again in chunks of this size (0: not; default 65536, with "
        "--quick 0)",
    )  # fmt: skip
    parser.add_argument("--keep", action="store_true", help="keep the state and logs")
    args = parser.parse_args(argv)
    plan = Plan(
        devices=args.devices,
        hold_s=args.hold,
        window_s=15.0 if args.quick else 45.0,
        uploaders=min(args.uploaders, args.devices),
        rounds=3 if args.quick else 10,
        blocks=1 if args.quick else 2,
        chunk_bytes=args.chunk_bytes,
        small_chunk_bytes=(
            args.small_chunk_bytes
            if args.small_chunk_bytes is not None
            else (0 if args.quick else SMALL_CHUNK_BYTES)
        ),
    )
    load = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="flotilla-bench-edge-"))
    try:
        result = report(plan, args.quick, asyncio.run(run(plan, work)), load)
    finally:
        if args.keep:
            print(f"edge: state and logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))
    lines = [f"{f['name']}: {f['value']:.3f} (limit {f['limit']})" for f in result["floors"]]
    ok = sum(f["ok"] for f in result["floors"])
    print(f"edge: floors {ok}/{len(result['floors'])} ok; " + "; ".join(lines), file=sys.stderr)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
