#!/usr/bin/env python
"""Federation load benchmark: many agents against a real server, on 127.0.0.1.

For each configuration (model size x agent count) it starts ``flotilla server`` as a
subprocess, runs N real :class:`flotilla.client.Agent` instances as asyncio tasks in this
process, submits a job of the synthetic task of that size and lets it run a few rounds.
Agents do no real training: each returns one precomputed update (random float32 deltas in
the model's layout), so the numbers are about the platform -- model download, update
upload, decoding, streaming aggregation, checkpointing -- not about torch.

It reports, per configuration: seconds per round (median of the job's round records,
``committed_at - started_at``), bytes moved per round, the server's RSS before and at peak
during the rounds, and the time a plain gRPC sink server (another subprocess, same channel
options, same concurrency, same 1 MiB chunks) takes to move the same bytes in this run.

Floors (reported, never an exit status):

- aggregation memory: peak server RSS during the rounds minus its RSS just after the job
  was submitted stays under ``3 x model_bytes + 64 MiB``, for every agent count;
- speed: a 10M-parameter round with 100 agents takes at most 3x the plain-gRPC time.

Stdout carries exactly one JSON object; a one-line summary goes to stderr.

    python benchmarks/federation.py --quick     # two configurations, under 2 minutes
    python benchmarks/federation.py             # {100k, 10M} x {10, 100} agents
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
from provenance import revision  # benchmarks/ is the script's sys.path[0]

from flotilla.cli.remote import RemoteServer
from flotilla.client import Agent, AgentConfig
from flotilla.client.training import TrainOutcome, TrainWork
from flotilla.core.blobs import CHUNK_BYTES, sha256_hex
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import decode_state, encode_state
from flotilla.core.work import WorkOrder
from flotilla.proto.channel import open_channel

MiB = 1024 * 1024
#: The constant in the memory floor: interpreter, gRPC and allocator slack, not the model.
MEMORY_CONSTANT_BYTES = 64 * MiB
MEMORY_MODEL_FACTOR = 3.0
#: A 10M x 100 round may take at most this many times the plain-gRPC transfer.
RATIO_LIMIT = 3.0
SAMPLE_EVERY_S = 0.02
SERVER_START_S = 60.0
AGENTS_READY_S = 120.0
JOB_TIMEOUT_S = 600.0
#: Passed to ``flotilla server --liveness``. The agent heartbeats only while it trains, so
#: with the server's default (30 s) an agent whose model download plus upload takes longer
#: is reaped mid-transfer -- which 100 agents sharing two cores do. ``--liveness`` overrides.
LIVENESS_S = 600.0
SINK_SERVICE = "flotilla.bench.Sink"

MODELS: dict[str, tuple[str, int]] = {
    "100k": ("flotilla.tasks.synthetic:Linear100K", 100_100),
    "10M": ("flotilla.tasks.synthetic:Linear10M", 10_001_000),
}

log = logging.getLogger("benchmarks.federation")


@dataclass(frozen=True)
class Config:
    model: str
    agents: int
    rounds: int

    @property
    def label(self) -> str:
        return f"{self.model} x{self.agents}"


FULL = [Config(m, n, 3) for m in ("100k", "10M") for n in (10, 100)]
QUICK = [Config("100k", 10, 2), Config("10M", 100, 1)]


# --- processes -----------------------------------------------------------------------------


@dataclass
class Process:
    """A child that prints ``listening on 127.0.0.1:PORT`` on stdout once it serves."""

    cmd: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout_s: float = SERVER_START_S) -> None:
        out = self.log_path.with_suffix(".out")
        with out.open("wb") as stdout, self.log_path.open("wb") as stderr:
            self.proc = subprocess.Popen(self.cmd, stdout=stdout, stderr=stderr)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if match := re.search(r"listening on 127\.0\.0\.1:(\d+)", out.read_text()):
                self.port = int(match.group(1))
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.cmd[:4]} did not start:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def flotilla_cli(*args: str, timeout_s: float = 60.0) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "flotilla", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"flotilla {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


class RssMonitor:
    """Samples a process's RSS every ``SAMPLE_EVERY_S`` and keeps the kernel's peak too.

    ``reset_peak`` writes 5 to ``/proc/PID/clear_refs``, which resets VmHWM, so the
    kernel's exact peak since then is read back alongside the sampled one (the sampler
    can miss a spike shorter than its period).
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._proc = psutil.Process(pid)
        self._lock = threading.Lock()
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-monitor", daemon=True)
        self.hwm_reset = False

    def __enter__(self) -> RssMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            try:
                rss = self._proc.memory_info().rss
            except psutil.Error:
                return
            with self._lock:
                self._peak = max(self._peak, rss)

    def current(self) -> int:
        return int(self._proc.memory_info().rss)

    def reset_peak(self) -> int:
        """Start a new peak window; returns the RSS at its start."""
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
        rss = self.current()
        with self._lock:
            self._peak = rss
        return rss

    def sampled_peak(self) -> int:
        with self._lock:
            return self._peak

    def vm_hwm(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0


class CpuClock:
    """CPU seconds (user + system) a child and this process spend from now on."""

    def __init__(self, pid: int) -> None:
        self._procs = (psutil.Process(pid), psutil.Process())
        self._start = tuple(self._seconds(p) for p in self._procs)

    @staticmethod
    def _seconds(proc: psutil.Process) -> float:
        t = proc.cpu_times()
        return float(t.user + t.system)

    def elapsed(self) -> tuple[float, float]:
        server, here = (self._seconds(p) - s for p, s in zip(self._procs, self._start, strict=True))
        return server, here


# --- agents --------------------------------------------------------------------------------


class SharedUpdate:
    """One update payload for every agent: small random deltas in the model's layout.

    Built once, from the first model an agent fetches, so the benchmark needs no torch.
    """

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._lock = threading.Lock()
        self.payload = b""
        self.sha256 = ""
        self.model_bytes = 0

    def get(self, model: bytes | memoryview) -> bytes:
        with self._lock:
            if not self.payload:
                rng = np.random.default_rng(self._seed)
                state = decode_state(model)
                delta = {
                    name: rng.standard_normal(arr.shape, dtype=np.float32) * np.float32(1e-3)
                    for name, arr in state.items()
                }
                self.payload = encode_state(delta)
                self.sha256 = sha256_hex(self.payload)
                self.model_bytes = len(model)
            return self.payload


@dataclass
class CannedTrainer:
    """What :class:`Agent` uses of ``LocalTrainer``, returning the shared update at once."""

    task_name: str
    update: SharedUpdate
    num_samples: int = 8

    def train(self, model_bytes: bytes | memoryview, work: TrainWork) -> TrainOutcome:
        payload = self.update.get(model_bytes)
        return TrainOutcome(self.num_samples, {"loss": 1.0}, payload, self.update.sha256)


class BenchAgent(Agent):
    """A real agent that does not keep the last model: 100 cached 40 MB copies in one
    benchmark process would measure this process, not the platform. ``connected`` says
    it has enrolled and measured its upload rate, so its next call is a poll."""

    connected = False

    async def _connect(self) -> None:
        await super()._connect()
        self.connected = True

    async def _fetch(self, task: WorkOrder) -> memoryview:
        data = await super()._fetch(task)
        self._model = None
        return data


async def wait_until(what: str, ready: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(0.05)


# --- one federation configuration ----------------------------------------------------------


async def run_federation(
    cfg: Config, workdir: Path, server_args: list[str], timeout_s: float
) -> dict[str, Any]:
    task_name, _ = MODELS[cfg.model]
    state = workdir / "state"
    server = Process(
        [
            sys.executable, "-m", "flotilla", "server", "--host", "127.0.0.1",
            "--port", "0", "--no-http", "--state-dir", str(state), *server_args,
            # Every agent on one loopback address: no per-address caps or enrol limit here.
            "--rate-limit", "enrol=100000/100000", "--max-connections", "100000",
        ],
        workdir / "server.log",
    )  # fmt: skip
    server.start()
    agent_tasks: list[asyncio.Task[None]] = []
    try:
        token = flotilla_cli("server", "token", "create", "--state-dir", str(state))
        token = token.strip().splitlines()[-1]
        operator = (state / "operator.token").read_text().strip()
        with RssMonitor(server.pid) as rss:
            update = SharedUpdate()
            agents = [
                BenchAgent(
                    AgentConfig(
                        server=server.address,
                        token=token,
                        trainer=CannedTrainer(task_name, update),  # type: ignore[arg-type]
                        backoff_cap_s=1.0,
                    ),
                    rng=random.Random(i),
                )
                for i in range(cfg.agents)
            ]
            t0 = time.perf_counter()
            agent_tasks = [asyncio.ensure_future(a.run()) for a in agents]

            def connected() -> bool:
                dead = [t for t in agent_tasks if t.done()]
                if dead:
                    dead[0].result()  # raises the agent's error
                    raise RuntimeError("an agent stopped before the job started")
                # Not "all in their first held poll": under load the first polls of 100
                # agents need not overlap, and a later poll carries no profile.
                return all(a.connected for a in agents)

            await wait_until("agents to enrol", connected, AGENTS_READY_S)
            await asyncio.sleep(0.5)  # their first polls land
            connect_s = time.perf_counter() - t0
            rss_idle = rss.current()
            hwm_setup = rss.vm_hwm()

            spec = JobSpec.from_dict(
                {
                    "job": {
                        "name": f"bench-{cfg.model}-x{cfg.agents}",
                        "task": task_name,
                        "rounds": cfg.rounds,
                        "clients_per_round": cfg.agents,
                        "min_quorum": cfg.agents,
                        "round_deadline_s": timeout_s,
                    }
                },
                "benchmark",
            )
            async with RemoteServer(server.address, operator) as remote:
                t_submit = time.perf_counter()
                info = await remote.submit(spec)
                rss_before = rss.reset_peak()
                cpu = CpuClock(server.pid)
                deadline = time.monotonic() + timeout_s
                while info.state not in ("completed", "failed", "cancelled"):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"job not done after {timeout_s:.0f}s")
                    await asyncio.sleep(0.1)
                    info = await remote.job(info.id)
                job_s = time.perf_counter() - t_submit
                server_cpu_s, bench_cpu_s = cpu.elapsed()
                rss_peak_sampled = rss.sampled_peak()
                hwm_round = rss.vm_hwm() if rss.hwm_reset else 0
                info = await remote.job(info.id, with_rounds=True)
        if info.state != "completed":
            raise RuntimeError(f"job ended {info.state}")
    finally:
        for t in agent_tasks:
            t.cancel()
        if agent_tasks:
            await asyncio.wait(agent_tasks, timeout=15)
        server.stop()

    round_s = [r.committed_at - r.started_at for r in info.rounds]
    model_bytes = update.model_bytes
    update_bytes = len(update.payload)
    rss_peak = max(rss_peak_sampled, hwm_round)
    aggregation = rss_peak - rss_before
    limit = int(MEMORY_MODEL_FACTOR * model_bytes + MEMORY_CONSTANT_BYTES)
    return {
        "label": cfg.label,
        "task": task_name,
        "model_params": MODELS[cfg.model][1],
        "model_bytes": model_bytes,
        "update_bytes": update_bytes,
        "agents": cfg.agents,
        "rounds": cfg.rounds,
        "seconds_per_round": statistics.median(round_s),
        "round_seconds": round_s,
        "bytes_per_round": cfg.agents * (model_bytes + update_bytes),
        "connect_seconds": connect_s,
        "job_seconds": job_s,
        "server_cpu_seconds_per_round": server_cpu_s / cfg.rounds,
        "agents_cpu_seconds_per_round": bench_cpu_s / cfg.rounds,
        "server_rss_idle": rss_idle,
        "server_rss_before": rss_before,
        "server_rss_peak": rss_peak,
        "server_rss_peak_sampled": rss_peak_sampled,
        "server_vmhwm_round": hwm_round,
        "server_vmhwm_setup": hwm_setup,
        "aggregation_bytes": aggregation,
        "aggregation_limit": limit,
        "aggregation_over_model": aggregation / model_bytes,
        "metrics": dict(info.rounds[-1].metrics) if info.rounds else {},
    }


# --- the plain gRPC baseline ---------------------------------------------------------------


async def serve_sink() -> None:
    """``--grpc-sink``: a bytes source and sink with the federation server's channel options."""
    chunk = bytes(CHUNK_BYTES)

    async def download(request: bytes, context: Any) -> AsyncIterator[bytes]:
        left = int(request)
        while left > 0:
            n = min(left, CHUNK_BYTES)
            yield chunk if n == CHUNK_BYTES else chunk[:n]
            left -= n

    async def upload(chunks: AsyncIterator[bytes], context: Any) -> bytes:
        total = 0
        async for data in chunks:
            total += len(data)
        return str(total).encode()

    handler = grpc.method_handlers_generic_handler(
        SINK_SERVICE,
        {
            "Download": grpc.unary_stream_rpc_method_handler(download),
            "Upload": grpc.stream_unary_rpc_method_handler(upload),
        },
    )
    limit = 8 * MiB  # ServerConfig.max_message_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
        ]
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"sink listening on 127.0.0.1:{port}", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)


async def sink_client(channel: grpc.aio.Channel, down: int, up: int) -> None:
    """One agent's bytes, without the agent: download ``down`` then upload ``up``."""
    download = channel.unary_stream(f"/{SINK_SERVICE}/Download")
    upload = channel.stream_unary(f"/{SINK_SERVICE}/Upload")
    got = 0
    async for data in download(str(down).encode(), timeout=JOB_TIMEOUT_S):
        got += len(data)
    if got != down:
        raise RuntimeError(f"sink sent {got} of {down} bytes")
    chunk = bytes(CHUNK_BYTES)

    async def chunks() -> AsyncIterator[bytes]:
        left = up
        while left > 0:
            n = min(left, CHUNK_BYTES)
            yield chunk if n == CHUNK_BYTES else chunk[:n]
            left -= n

    reply = await upload(chunks(), timeout=JOB_TIMEOUT_S)
    if int(reply) != up:
        raise RuntimeError(f"sink took {int(reply)} of {up} bytes")


async def run_baseline(
    agents: int, down: int, up: int, repeats: int, workdir: Path
) -> tuple[list[float], float, float]:
    """Seconds for each repeat, then sink and client CPU seconds per repeat."""
    sink = Process([sys.executable, __file__, "--grpc-sink"], workdir / "sink.log")
    sink.start()
    channels = [open_channel(sink.address) for _ in range(agents)]
    try:
        await asyncio.gather(*(sink_client(ch, 1, 1) for ch in channels))  # connect
        times = []
        cpu = CpuClock(sink.pid)
        for _ in range(repeats):
            t0 = time.perf_counter()
            await asyncio.gather(*(sink_client(ch, down, up) for ch in channels))
            times.append(time.perf_counter() - t0)
        sink_cpu, client_cpu = cpu.elapsed()
        return times, sink_cpu / repeats, client_cpu / repeats
    finally:
        for ch in channels:
            await ch.close(None)
        sink.stop()


# --- the run -------------------------------------------------------------------------------


@dataclass
class Report:
    mode: str
    server_args: list[str]
    #: 1-minute load average at the start and end: other work on the machine skews timings.
    load: list[float] = field(default_factory=lambda: [os.getloadavg()[0]])
    configs: list[dict[str, Any]] = field(default_factory=list)
    floors: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def floor(self, name: str, value: float | None, limit: float) -> None:
        ok = value is not None and value <= limit
        self.floors.append({"name": name, "value": value, "limit": limit, "ok": ok})

    def to_json(self) -> dict[str, Any]:
        return {
            "benchmark": "federation",
            "mode": self.mode,
            "machine": {
                "cpus": os.cpu_count(),
                "memory_bytes": psutil.virtual_memory().total,
                "python": platform.python_version(),
                "grpcio": grpc.__version__,
                "platform": platform.platform(),
                "load_average_1m": [*self.load, os.getloadavg()[0]],
            },
            "memory_floor": {
                "model_factor": MEMORY_MODEL_FACTOR,
                "constant_bytes": MEMORY_CONSTANT_BYTES,
            },
            "ratio_limit": RATIO_LIMIT,
            "server_args": self.server_args,
            "revision": revision(),
            "configs": self.configs,
            "floors": self.floors,
            "derived": derived(self.configs),
            "notes": self.notes,
        }


def derived(configs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per agent count, how aggregation memory grows with the model (bytes per model byte)."""
    out: dict[str, Any] = {}
    ok = [c for c in configs if "error" not in c]
    for n in sorted({c["agents"] for c in ok}):
        small = [c for c in ok if c["agents"] == n and c["model_params"] == MODELS["100k"][1]]
        big = [c for c in ok if c["agents"] == n and c["model_params"] == MODELS["10M"][1]]
        if small and big:
            s, b = small[0], big[0]
            slope = (b["aggregation_bytes"] - s["aggregation_bytes"]) / (
                b["model_bytes"] - s["model_bytes"]
            )
            out[f"aggregation_slope_x{n}"] = slope
    return out


async def run(
    configs: list[Config],
    mode: str,
    server_args: list[str],
    timeout_s: float = JOB_TIMEOUT_S,
    keep: bool = False,
) -> Report:
    report = Report(mode, server_args)
    for cfg in configs:
        workdir = Path(tempfile.mkdtemp(prefix=f"flotilla-bench-{cfg.model}-{cfg.agents}-"))
        try:
            log.warning("running %s, %d round(s)", cfg.label, cfg.rounds)
            result = await run_federation(cfg, workdir, server_args, timeout_s)
            times, sink_cpu, client_cpu = await run_baseline(
                cfg.agents,
                result["model_bytes"],
                result["update_bytes"],
                max(cfg.rounds, 2),
                workdir,
            )
            result["baseline_seconds"] = statistics.median(times)
            result["baseline_runs"] = times
            result["baseline_server_cpu_seconds"] = sink_cpu
            result["baseline_clients_cpu_seconds"] = client_cpu
            result["ratio_to_grpc"] = result["seconds_per_round"] / result["baseline_seconds"]
            # The server's own share: its CPU per round against the sink's for the same bytes.
            result["server_cpu_ratio_to_grpc"] = result["server_cpu_seconds_per_round"] / max(
                sink_cpu, 1e-3
            )
            result["round_bytes_per_s"] = result["bytes_per_round"] / result["seconds_per_round"]
            result["baseline_bytes_per_s"] = result["bytes_per_round"] / result["baseline_seconds"]
        except Exception as exc:  # report it, go on with the other configurations
            log.exception("%s failed", cfg.label)
            result = {"label": cfg.label, "agents": cfg.agents, "error": repr(exc)}
            result["model_params"] = MODELS[cfg.model][1]
            result["server_log_tail"] = _tail(workdir / "server.log")
        finally:
            if keep:
                log.warning("kept %s", workdir)
            else:
                shutil.rmtree(workdir, ignore_errors=True)
        report.configs.append(result)
        report.floor(
            f"aggregation_memory {cfg.label}",
            result.get("aggregation_bytes"),
            result.get("aggregation_limit", 0),
        )
        if cfg.model == "10M" and cfg.agents == max(c.agents for c in configs if c.model == "10M"):
            if cfg.agents != 100:
                report.notes.append(f"speed floor measured at {cfg.agents} agents, not 100")
            report.floor(f"round_vs_grpc {cfg.label}", result.get("ratio_to_grpc"), RATIO_LIMIT)
    return report


def _tail(path: Path, chars: int = 2000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text()[-chars:]
    return ""


def summary(report: Report) -> str:
    parts = []
    for c in report.configs:
        if "error" in c:
            parts.append(f"{c['label']}: ERROR")
            continue
        parts.append(
            f"{c['label']}: {c['seconds_per_round']:.2f}s/round "
            f"({c['ratio_to_grpc']:.2f}x grpc), {c['bytes_per_round'] / MiB:.0f} MiB/round, "
            f"agg mem {c['aggregation_bytes'] / MiB:.0f} MiB "
            f"({c['aggregation_over_model']:.1f}x model)"
        )
    ok = sum(f["ok"] for f in report.floors)
    failed = [f["name"] for f in report.floors if not f["ok"]]
    tail = f"floors {ok}/{len(report.floors)} ok" + (
        f" (failed: {', '.join(failed)})" if failed else ""
    )
    return "federation: " + "; ".join(parts) + "; " + tail


def parse_config(text: str) -> Config:
    """``MODEL:AGENTS[:ROUNDS]``, e.g. ``10M:100:2``."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or parts[0] not in MODELS:
        raise argparse.ArgumentTypeError(f"want MODEL:AGENTS[:ROUNDS] with MODEL in {list(MODELS)}")
    try:
        agents, rounds = int(parts[1]), int(parts[2]) if len(parts) == 3 else 2
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if agents < 1 or rounds < 1:
        raise argparse.ArgumentTypeError("agents and rounds must be >= 1")
    return Config(parts[0], agents, rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100k x10 and 10M x100, 1-2 rounds")
    parser.add_argument(
        "--config",
        type=parse_config,
        action="append",
        default=[],
        metavar="MODEL:AGENTS[:ROUNDS]",
        help="run only these configurations (repeatable), e.g. 10M:100:2",
    )
    parser.add_argument("--rounds", type=int, default=None, help="rounds per configuration")
    parser.add_argument(
        "--liveness",
        type=float,
        default=LIVENESS_S,
        help=f"server --liveness SECONDS (default {LIVENESS_S:.0f}; the server's own is 30)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=JOB_TIMEOUT_S,
        help=f"seconds a configuration's job may take (default {JOB_TIMEOUT_S:.0f})",
    )
    parser.add_argument("--keep", action="store_true", help="keep state dirs and server logs")
    parser.add_argument("--json-only", action="store_true", help="no summary line on stderr")
    parser.add_argument("--grpc-sink", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.grpc_sink:
        asyncio.run(serve_sink())
        return 0
    mode = "custom" if args.config else "quick" if args.quick else "full"
    configs = args.config or (QUICK if args.quick else FULL)
    if args.rounds is not None:
        configs = [Config(c.model, c.agents, args.rounds) for c in configs]
    server_args = ["--liveness", str(args.liveness)]
    report = asyncio.run(run(configs, mode, server_args, args.timeout, args.keep))
    print(json.dumps(report.to_json(), indent=2))
    if not args.json_only:
        print(summary(report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
