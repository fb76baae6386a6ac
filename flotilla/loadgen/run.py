"""A load run: a real server, hundreds of protocol-true devices, and the books checked after.

:func:`run_load` starts ``flotilla server`` (its own state directory; SQLite or the
PostgreSQL a plan names), submits jobs of a synthetic task over the HTTP API, and starts
worker processes (``flotilla.loadgen.worker``) that run the devices as asyncio tasks on the
gRPC or the HTTP edge. While they run it samples the server process every second (RSS,
file descriptors, threads, CPU) and its ``/metrics`` (event-loop tasks). Afterwards it
reads every committed round back and checks that each update a device saw accepted was
committed exactly once. Every process it starts dies with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from flotilla.core.errors import FlotillaError
from flotilla.core.lifetime import bound
from flotilla.core.timeouts import Timeouts
from flotilla.loadgen.device import CALLS, Accepted
from flotilla.loadgen.latency import LatencyHistogram
from flotilla.loadgen.operator import CommittedRound, OperatorApi, gauge
from flotilla.loadgen.worker import WIND_DOWN_S, WorkerPlan, WorkerReport

#: The synthetic task of the load runs: 100,100 parameters, one SGD step, no data.
LOAD_TASK = "flotilla.tasks.synthetic:Linear100K"
SAMPLE_EVERY_S = 1.0
SCRAPE_EVERY_S = 5.0
#: Liveness window of the load server: a device starved of CPU on a loaded machine is late,
#: not gone.
LIVENESS_S = 120.0

Say = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class LoadPlan:
    devices: int
    duration_s: float
    edge: str = "grpc"
    #: Processes the devices are spread over.
    workers: int = 2
    #: Jobs running at once, each selecting ``clients_per_round`` devices a round.
    jobs: int = 2
    clients_per_round: int = 50
    poll_every_s: float = 1.0
    #: The server's poll hold. 0: polls are answered at once and idle devices poll every
    #: ``poll_every_s`` (poll latency is the server's answer time). Above 0: long polls,
    #: and a device polls again as soon as one comes back empty (the latency includes the
    #: hold; work reaches a device as soon as it is dispatched).
    poll_hold_s: float = 0.0
    #: Devices start spread over this many seconds (None: a quarter of the run, <= 20 s).
    ramp_s: float | None = None
    task: str = LOAD_TASK
    db_url: str | None = None
    round_deadline_s: float = 30.0
    seed: int = 0
    #: Server processes of one deployment (same database and state directory); devices
    #: get every address, each worker's list starting at a different one. The servers
    #: share the jobs (``jobs`` should be at least ``servers``) and send idle devices to
    #: each other as their jobs need.
    servers: int = 1

    def __post_init__(self) -> None:
        if self.edge not in ("grpc", "http"):
            raise FlotillaError(f"edge must be grpc or http, got {self.edge!r}")
        if self.devices < 1 or self.workers < 1 or self.jobs < 1 or self.clients_per_round < 1:
            raise FlotillaError("devices, workers, jobs and clients_per_round must be >= 1")
        if self.servers < 1 or (self.servers > 1 and self.edge != "grpc"):
            raise FlotillaError("servers must be >= 1; several servers need the grpc edge")
        if not self.duration_s > 0 or not self.poll_every_s > 0 or not self.poll_hold_s >= 0:
            raise FlotillaError("duration and poll interval must be > 0 seconds, hold >= 0")

    @property
    def per_round(self) -> int:
        """Devices a round selects: ``clients_per_round``, or fewer when the jobs together
        would need more devices than there are."""
        return max(1, min(self.clients_per_round, self.devices // self.jobs))

    @property
    def ramp(self) -> float:
        return self.ramp_s if self.ramp_s is not None else min(20.0, self.duration_s / 4)


@dataclass(frozen=True, slots=True)
class ServerSample:
    t: float
    rss: int
    fds: int
    threads: int
    cpu_s: float


@dataclass(slots=True)
class ServerWatch:
    samples: list[ServerSample] = field(default_factory=list)
    #: (seconds since the start, asyncio tasks on the server's loop)
    tasks: list[tuple[float, int]] = field(default_factory=list)


class ServerProcess:
    """``flotilla server`` as a child, bound to this process's life."""

    def __init__(
        self, state_dir: Path, db_url: str | None, log_path: Path, poll_hold_s: float = 0.0
    ) -> None:
        self.state_dir = state_dir
        self._db_url = db_url
        self._poll_hold_s = poll_hold_s
        self._log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self.grpc_address = ""
        self.http_url = ""

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def start(self) -> None:
        argv = [
            sys.executable, "-m", "flotilla", "server", "--host", "127.0.0.1", "--port", "0",
            "--http-port", "0", "--state-dir", str(self.state_dir),
            "--poll-hold", str(self._poll_hold_s),
            "--liveness", str(LIVENESS_S),
            # Every device comes from 127.0.0.1: per-address caps would cap the test.
            "--rate-limit", "enrol=100000/100000", "--max-connections", "1000000",
        ]  # fmt: skip
        if self._db_url:
            argv += ["--db", self._db_url]
        with self._log_path.open("wb") as log:
            self._proc = subprocess.Popen(bound(argv), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + Timeouts().child_start_s
        while time.monotonic() < deadline:
            text = self._log_path.read_text(errors="replace")
            port = re.search(r"listening on 127\.0\.0\.1:(\d+)", text)
            url = re.search(r"^dashboard: (\S+)", text, re.MULTILINE)
            if port and url:
                self.grpc_address = f"127.0.0.1:{port.group(1)}"
                self.http_url = url.group(1).rstrip("/")
                return
            if self._proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise FlotillaError(f"the server did not start:\n{self._log_path.read_text()[-3000:]}")

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after ``Timeouts.child_stop_s``; the exit status."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(Timeouts().child_stop_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        return self._proc.returncode


def make_token(state_dir: Path, db_url: str | None) -> str:
    argv = [sys.executable, "-m", "flotilla", "server", "token", "create",
            "--state-dir", str(state_dir)]  # fmt: skip
    if db_url:
        argv += ["--db", db_url]
    out = subprocess.run(bound(argv), capture_output=True, text=True, timeout=120, check=False)
    if out.returncode != 0:
        raise FlotillaError(f"token create failed: {out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


def job_toml(plan: LoadPlan, index: int) -> str:
    quorum = max(1, plan.per_round // 2)
    return (
        f'[job]\nname = "load-{index}"\ntask = "{plan.task}"\nrounds = 1000000\n'
        f"clients_per_round = {plan.per_round}\nmin_quorum = {quorum}\n"
        f"round_deadline_s = {plan.round_deadline_s}\nseed = {plan.seed + index}\n"
    )


async def _watch(pid: int, api: OperatorApi, watch: ServerWatch, stop: asyncio.Event) -> None:
    proc = psutil.Process(pid)
    start = time.monotonic()
    next_scrape = 0.0
    while not stop.is_set():
        now = time.monotonic() - start
        with contextlib.suppress(psutil.Error), proc.oneshot():
            t = proc.cpu_times()
            rss, fds, threads = proc.memory_info().rss, proc.num_fds(), proc.num_threads()
            watch.samples.append(ServerSample(now, rss, fds, threads, t.user + t.system))
        if now >= next_scrape:
            next_scrape = now + SCRAPE_EVERY_S
            with contextlib.suppress(FlotillaError, OSError, asyncio.TimeoutError):
                tasks = gauge(await api.metrics(), "flotilla_event_loop_tasks")
                if tasks is not None:
                    watch.tasks.append((now, int(tasks)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)


async def _worker(plan: WorkerPlan) -> WorkerReport:
    proc = await asyncio.create_subprocess_exec(
        *bound([sys.executable, "-m", "flotilla.loadgen.worker"]),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(
            proc.communicate(plan.to_json().encode()),
            plan.duration_s + plan.ramp_s + WIND_DOWN_S + 60.0,
        )
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if proc.returncode != 0 or not out.strip():
        raise FlotillaError(f"a load worker failed ({proc.returncode}):\n{err.decode()[-3000:]}")
    return WorkerReport.from_json(json.loads(out.decode().strip().splitlines()[-1]))


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


async def run_load(plan: LoadPlan, workdir: Path | None = None,
                   progress: Say | None = None) -> dict[str, Any]:  # fmt: skip
    """Run ``plan`` and return its results (one JSON-ready object)."""
    say = progress or (lambda _: None)
    with _workdir(workdir) as root:
        servers = [
            ServerProcess(root / "state", plan.db_url, root / f"server-{i}.log", plan.poll_hold_s)
            for i in range(plan.servers)
        ]
        try:
            for server in servers:
                say("starting the server")
                await asyncio.to_thread(server.start)
            return await _run(plan, servers, say)
        finally:
            say("stopping the server")
            for server in reversed(servers):
                await asyncio.to_thread(server.stop)


def _starting_at(addresses: list[str], worker: int) -> str:
    """Every address, each worker's list starting at a different server: the devices
    spread over the deployment (and move between its servers as their jobs need)."""
    at = worker % len(addresses)
    return ",".join(addresses[at:] + addresses[:at])


@contextlib.contextmanager
def _workdir(given: Path | None) -> Iterator[Path]:
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="flotilla-load-") as tmp:
        yield Path(tmp)


async def _run(plan: LoadPlan, servers: list[ServerProcess], say: Say) -> dict[str, Any]:
    server = servers[0]  # the operator API goes to it (any server of a deployment would do)
    token = await asyncio.to_thread(make_token, server.state_dir, plan.db_url)
    operator = (server.state_dir / "operator.token").read_text().strip()
    addresses = (
        [s.http_url for s in servers] if plan.edge == "http" else [s.grpc_address for s in servers]
    )
    async with OperatorApi(server.http_url, operator) as api:
        job_ids = [await api.submit(job_toml(plan, i)) for i in range(plan.jobs)]
        watch = ServerWatch()
        stop = asyncio.Event()
        watcher = asyncio.ensure_future(_watch(server.pid, api, watch, stop))
        plans = [
            WorkerPlan(plan.edge, _starting_at(addresses, w), token, plan.task, n, plan.duration_s,
                       0.0 if plan.poll_hold_s > 0 else plan.poll_every_s, plan.ramp,
                       plan.seed * 1000 + w)
            for w, n in enumerate(_split(plan.devices, plan.workers)) if n
        ]  # fmt: skip
        say(f"{plan.devices} devices on {len(plans)} workers for {plan.duration_s:.0f}s")
        started = time.monotonic()
        before = CpuUse.now(servers)
        try:
            reports = await asyncio.gather(*(_worker(p) for p in plans))
        finally:
            stop.set()
            await watcher
        elapsed = time.monotonic() - started
        cpu = CpuUse.now(servers).since(before)
        for job_id in job_ids:
            with contextlib.suppress(FlotillaError):
                await api.cancel(job_id)
        rounds = [r for job_id in job_ids for r in await api.rounds(job_id)]
        retried = _retries(await api.metrics())
    result = summarize(plan, reports, rounds, watch, elapsed, retried, os.cpu_count() or 1)
    result["deployment"] = cpu.summary(result["accepted_updates"])
    return result


@dataclass(frozen=True, slots=True)
class CpuUse:
    """CPU seconds of the deployment's server processes and of the whole machine."""

    servers_s: float
    machine_busy_s: float
    machine_s: float

    @staticmethod
    def now(servers: list[ServerProcess]) -> CpuUse:
        used = 0.0
        for server in servers:
            with contextlib.suppress(psutil.Error):
                t = psutil.Process(server.pid).cpu_times()
                used += t.user + t.system
        machine = psutil.cpu_times()
        idle = machine.idle + getattr(machine, "iowait", 0.0)
        # Guest time is counted in user time already.
        total = sum(machine) - getattr(machine, "guest", 0.0) - getattr(machine, "guest_nice", 0.0)
        return CpuUse(used, total - idle, total)

    def since(self, start: CpuUse) -> CpuUse:
        return CpuUse(
            self.servers_s - start.servers_s,
            self.machine_busy_s - start.machine_busy_s,
            self.machine_s - start.machine_s,
        )

    def summary(self, accepted: int) -> dict[str, float]:
        """Server CPU per accepted update (the work two servers split), and how busy the
        machine was (when it is near 1.0, a second server has no core to run on)."""
        return {
            "servers_cpu_s": round(self.servers_s, 2),
            "cpu_ms_per_update": round(1000 * self.servers_s / accepted, 2) if accepted else 0.0,
            "machine_busy": round(self.machine_busy_s / self.machine_s, 3)
            if self.machine_s
            else 0.0,
        }


def _retries(exposition: str) -> int:
    total = 0.0
    for line in exposition.splitlines():
        if line.startswith("flotilla_rounds_retried_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def summarize(
    plan: LoadPlan,
    reports: list[WorkerReport],
    rounds: list[CommittedRound],
    watch: ServerWatch,
    elapsed_s: float,
    retried_rounds: int,
    cpus: int,
) -> dict[str, Any]:
    """The run's results: latencies, throughput, the books, the server's resources."""
    latencies = {c: LatencyHistogram() for c in CALLS}
    errors: Counter[str] = Counter()
    accepted: list[Accepted] = []
    for report in reports:
        for call, hist in report.latencies.items():
            latencies[call].merge(hist)
        errors.update(report.errors)
        accepted.extend(report.accepted)
    books = check_books(accepted, rounds)
    span = [r.committed_at - r.started_at for r in rounds]
    return {
        "edge": plan.edge,
        "devices": plan.devices,
        "duration_s": plan.duration_s,
        "elapsed_s": round(elapsed_s, 1),
        "workers": plan.workers,
        "jobs": plan.jobs,
        "clients_per_round": plan.per_round,
        "poll_every_s": 0.0 if plan.poll_hold_s > 0 else plan.poll_every_s,
        "poll_hold_s": plan.poll_hold_s,
        "task": plan.task,
        "database": "postgresql" if plan.db_url else "sqlite",
        "servers": plan.servers,
        "enrolled": sum(r.enrolled for r in reports),
        "stuck_devices": sum(r.stuck for r in reports),
        "latency_ms": {
            call: {"count": h.total, "p50": _ms(h.quantile_s(0.5)), "p99": _ms(h.quantile_s(0.99))}
            for call, h in latencies.items()
        },
        "accepted_updates": len(accepted),
        "accepted_per_s": round(len(accepted) / plan.duration_s, 1),
        "not_accepted": sum(r.not_accepted for r in reports),
        "errors": dict(sorted(errors.items())),
        "rounds_committed": len(rounds),
        "retried_rounds": retried_rounds,
        "round_seconds": {"p50": _quantile(span, 0.5), "p99": _quantile(span, 0.99)},
        **books,
        "server": server_summary(watch, cpus),
    }


def check_books(accepted: list[Accepted], rounds: list[CommittedRound]) -> dict[str, int]:
    """Each accepted update committed exactly once.

    ``lost``: accepted for a round that committed without it (with no retried rounds, a
    bug); ``duplicated``: a device accepted twice in one round, or listed twice among a
    committed round's participants; ``uncommitted``: accepted in rounds that had not
    committed when the run ended.
    """
    seen = Counter((a.job, a.round, a.device) for a in accepted)
    committed = {(r.job, r.round): r.participants for r in rounds}
    lost = uncommitted = 0
    for (job, rnd, device), _ in seen.items():
        members = committed.get((job, rnd))
        if members is None:
            uncommitted += 1
        elif device not in members:
            lost += 1
    duplicated = sum(n - 1 for n in seen.values() if n > 1)
    duplicated += sum(len(r.participants) - len(set(r.participants)) for r in rounds)
    return {"lost_updates": lost, "duplicated_updates": duplicated,
            "uncommitted_at_end": uncommitted}  # fmt: skip


def server_summary(watch: ServerWatch, cpus: int) -> dict[str, Any]:
    s = watch.samples
    if len(s) < 2:
        return {}
    half = s[len(s) // 2]
    last = s[-1]
    busy_s = last.t - s[0].t
    tasks = [n for _, n in watch.tasks]
    return {
        "cpu_cores_used": round((last.cpu_s - s[0].cpu_s) / busy_s, 2) if busy_s else 0.0,
        "machine_cores": cpus,
        "rss_mib": {
            "start": _mib(s[0].rss),
            "mid": _mib(half.rss),
            "end": _mib(last.rss),
            "peak": _mib(max(x.rss for x in s)),
        },
        "rss_growth_second_half": round(last.rss / half.rss - 1.0, 4),
        "fds": {"mid": half.fds, "end": last.fds, "max": max(x.fds for x in s)},
        "threads": {"mid": half.threads, "end": last.threads, "max": max(x.threads for x in s)},
        "event_loop_tasks": {
            "mid": tasks[len(tasks) // 2] if tasks else None,
            "end": tasks[-1] if tasks else None,
            "max": max(tasks) if tasks else None,
        },
    }


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 2)


def _mib(n: int) -> float:
    return round(n / 2**20, 1)


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))], 3)
