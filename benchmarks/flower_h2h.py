#!/usr/bin/env python
"""Head-to-head on Flower's simulation benchmark workload: ``flotilla simulate`` against a
bare per-client PyTorch loop on one thread, and against Flower itself when it is installed.

The workload (``examples/own_task/flower_mlp.py``, docs/simulation.md#bring-your-own-task):
an MLP 784-128-10 (101,770 parameters), 50 synthetic examples per client, plain SGD with
learning rate 0.1, batch 32, one local epoch, FedAvg over every client each round.

Each side runs in a process of its own, so its peak RSS is its own: the most the process
and every process below it held at once (sampled every 50 ms), or its own ``wait4`` peak
if larger. For C = 100, 1,000 and 10,000 clients:

- ``flotilla``: ``python -m flotilla simulate examples/own_task/flower-mlp.toml --clients C``
  with every client in every round (``clients_per_round = min_quorum = C``), no plots. A
  round is the ``wall_seconds`` difference of consecutive ``metrics.jsonl`` rows: selection,
  training, the update pipeline, FedAvg, the checkpoint, held-out evaluation. Round 1 also
  builds every client's data and warms up: reported, not timed.
- ``loop``: the same task's data and model in a bare loop, ``torch.set_num_threads(1)``:
  for each client the global weights copied into one model, a fresh ``torch.optim.SGD``,
  ``randperm`` batches, forward/backward/step; FedAvg (the sample-weighted mean of the
  local models) after the last client. Data is built before the clock starts. Above
  ``--loop-sample`` clients it trains that many and is scaled by C / sample.
- ``flower``: with ``--flower-python PY`` (an interpreter whose environment has
  ``flwr[simulation]``: Flower is never a dependency of ours), Flower's ``run_simulation``
  with a ``NumPyClient`` per client training exactly as the loop does, every client fit
  each round; a round is the time between consecutive rounds' aggregations.

Floors (reported, never an exit status): at C = 1,000, flotilla at least 2.5x faster than
the one-thread loop (``speedup_vs_loop``); flotilla's peak RSS at 10,000 clients at most
1.5x that at 1,000 (``rss_10k_vs_1k``).

Stdout carries one JSON object; a summary line goes to stderr.

    python benchmarks/flower_h2h.py --quick      # C = 100, 1,000, 10,000, fewer rounds
    python benchmarks/flower_h2h.py --flower-python /tmp/flwr-venv/bin/python
    python benchmarks/flower_h2h.py --devices cuda:0 --sizes 1000,10000   # one GPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from provenance import revision  # benchmarks/ is the script's sys.path[0]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "own_task" / "flower-mlp.toml"
TASK_DIR = EXAMPLE.parent
LEARNING_RATE, BATCH, SEED = 0.1, 32, 0
FLOOR_CLIENTS = 1000
SPEEDUP_LIMIT = 2.5
RSS_LIMIT = 1.5
#: Longest a side may take at one size before it is stopped and reported as an error.
SIDE_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Plan:
    sizes: tuple[int, ...]
    #: Timed rounds per C (after one untimed first round), every side.
    rounds: dict[int, int]
    loop_sample: int


QUICK = Plan(sizes=(100, 1000, 10_000), rounds={100: 3, 1000: 2, 10_000: 1}, loop_sample=1000)
FULL = Plan(sizes=(100, 1000, 10_000), rounds={100: 5, 1000: 5, 10_000: 3}, loop_sample=10_000)


@dataclass(frozen=True)
class Ran:
    """A side's process: what it printed and its peak resident memory."""

    stdout: str
    stderr: str
    returncode: int
    peak_rss_bytes: int
    seconds: float


def run_process(cmd: Sequence[str], cwd: Path, env: dict[str, str] | None = None) -> Ran:
    """Run ``cmd`` to the end. Its peak RSS: the larger of its own (``wait4``) and the most
    its whole process tree held at once, sampled every 50 ms (Flower's Ray workers are
    processes of their own)."""
    import psutil

    start = time.perf_counter()
    tree_peak = 0
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=out, stderr=err)
        deadline = time.monotonic() + SIDE_TIMEOUT_S
        root = psutil.Process(proc.pid)
        while True:
            tree_peak = max(tree_peak, _tree_rss(root))
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                for child in root.children(recursive=True):
                    child.kill()
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Ran(
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
            proc.returncode,
            max(int(usage.ru_maxrss) * 1024, tree_peak),  # ru_maxrss: kilobytes on Linux
            time.perf_counter() - start,
        )


def _tree_rss(root: Any) -> int:
    """Resident bytes of ``root`` and every process below it, now."""
    import psutil

    total = 0
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


def best_and_median(runs: list[float]) -> dict[str, Any]:
    return {"seconds": min(runs), "median_seconds": statistics.median(runs), "runs": runs}


# --- flotilla --------------------------------------------------------------------------------


def run_flotilla(clients: int, rounds: int, workdir: Path, devices: str) -> dict[str, Any]:
    out = workdir / f"flotilla-{clients}"
    sets = {
        "job.rounds": rounds + 1,
        "job.clients_per_round": clients,
        "job.min_quorum": clients,
        "population.dropout": 0.0,
    }
    cmd = [sys.executable, "-m", "flotilla", "simulate", str(EXAMPLE), "--clients", str(clients),
           "--out", str(out), "--no-progress", "--no-plots", "--json",
           "--devices", devices]  # fmt: skip
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    ran = run_process(cmd, workdir)
    if ran.returncode != 0:
        return {"error": ran.stderr[-2000:]}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    short = [r["round"] for r in rows if r["participants"] != clients]
    if len(rows) != rounds + 1 or short:
        return {"error": f"expected {rounds + 1} rounds of {clients} clients, got {rows!r:.500}"}
    walls = [r["wall_seconds"] for r in rows]
    summary = json.loads(ran.stdout)
    return {
        **best_and_median([b - a for a, b in itertools.pairwise(walls)]),
        "first_round_seconds": walls[0],
        "process_seconds": ran.seconds,
        "peak_rss_bytes": ran.peak_rss_bytes,
        "trainer": summary.get("trainer"),
        "accuracy": [r.get("accuracy") for r in rows],
    }


# --- the bare loop ---------------------------------------------------------------------------


def bare_loop(clients: int, trained: int, rounds: int) -> dict[str, Any]:
    """In this process (started for it): ``rounds + 1`` FedAvg rounds of ``trained``
    clients one after another on one thread; the first is not timed."""
    import torch

    from flotilla.core.spec import DataSection
    from flotilla.tasks import Shard, importable_from, load_task

    torch.set_num_threads(1)
    with importable_from([TASK_DIR]):
        task = load_task("flower_mlp:FlowerMLP")
    shards = [task.load_shard(Shard(i, clients), DataSection()).train for i in range(trained)]
    model = task.build_model(SEED)
    params = list(model.parameters())
    global_ = [p.detach().clone() for p in params]
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for r in range(rounds + 1):
        start = time.perf_counter()
        total = [torch.zeros_like(g) for g in global_]
        samples = 0
        for x, y in shards:
            with torch.no_grad():
                for p, g in zip(params, global_, strict=True):
                    p.copy_(g)
            opt = torch.optim.SGD(params, lr=LEARNING_RATE)
            gen = torch.Generator().manual_seed(r)
            for idx in torch.randperm(len(y), generator=gen).split(BATCH):
                loss = loss_fn(model(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                for t, p in zip(total, params, strict=True):
                    t.add_(p, alpha=len(y))
            samples += len(y)
        global_ = [t / samples for t in total]
        times.append(time.perf_counter() - start)
    return {"round_seconds": times[1:], "first_round_seconds": times[0]}


def run_loop(clients: int, rounds: int, sample: int, workdir: Path) -> dict[str, Any]:
    trained = min(clients, sample)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--bare-loop", str(clients),
           "--trained", str(trained), "--rounds", str(rounds)]  # fmt: skip
    ran = run_process(cmd, workdir)
    if ran.returncode != 0:
        return {"error": ran.stderr[-2000:]}
    got = json.loads(ran.stdout)
    scale = clients / trained
    return {
        **best_and_median([s * scale for s in got["round_seconds"]]),
        "scaled_from_clients": trained if trained < clients else None,
        "peak_rss_bytes": ran.peak_rss_bytes if trained == clients else None,
    }


# --- Flower ----------------------------------------------------------------------------------

FLOWER_SCRIPT = r"""
import json, sys, time
from pathlib import Path
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import numpy as np, torch
import flwr
from flwr.client import ClientApp, NumPyClient
from flwr.common import Context, ndarrays_to_parameters
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.simulation import run_simulation
from flower_mlp import FlowerMLP
from flotilla.core.spec import DataSection
from flotilla.tasks import Shard

CLIENTS, ROUNDS = int(sys.argv[3]), int(sys.argv[4])
LR, BATCH = float(sys.argv[5]), int(sys.argv[6])
TASK = FlowerMLP()
STAMPS = []

class Client(NumPyClient):
    def __init__(self, index):
        self.x, self.y = TASK.load_shard(Shard(index, CLIENTS), DataSection()).train
        self.model = TASK.build_model(0)
    def fit(self, parameters, config):
        params = list(self.model.parameters())
        with torch.no_grad():
            for p, v in zip(params, parameters):
                p.copy_(torch.from_numpy(v))
        opt = torch.optim.SGD(params, lr=LR)
        gen = torch.Generator().manual_seed(int(config.get("round", 0)))
        for idx in torch.randperm(len(self.y), generator=gen).split(BATCH):
            loss = torch.nn.functional.cross_entropy(self.model(self.x[idx]), self.y[idx])
            opt.zero_grad(); loss.backward(); opt.step()
        return [p.detach().numpy().copy() for p in params], len(self.y), {}

def client_fn(context: Context):
    return Client(int(context.node_config["partition-id"])).to_client()

class Timed(FedAvg):
    def aggregate_fit(self, server_round, results, failures):
        out = super().aggregate_fit(server_round, results, failures)
        STAMPS.append((server_round, time.perf_counter(), len(results), len(failures)))
        return out

def server_fn(context: Context):
    init = [p.detach().numpy() for p in TASK.build_model(0).parameters()]
    strategy = Timed(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=CLIENTS,
                     min_available_clients=CLIENTS,
                     initial_parameters=ndarrays_to_parameters(init),
                     on_fit_config_fn=lambda r: {"round": r})
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=ROUNDS))

start = time.perf_counter()
run_simulation(server_app=ServerApp(server_fn=server_fn), client_app=ClientApp(client_fn=client_fn),
               num_supernodes=CLIENTS,
               backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                               "init_args": {"include_dashboard": False, "num_cpus": 2}})
print(json.dumps({"stamps": STAMPS, "start": start, "flwr": flwr.__version__}))
"""


def run_flower(python: str, clients: int, rounds: int, workdir: Path) -> dict[str, Any]:
    script = workdir / "flower_side.py"
    script.write_text(FLOWER_SCRIPT)
    cmd = [python, str(script), str(TASK_DIR), str(ROOT), str(clients), str(rounds + 1),
           str(LEARNING_RATE), str(BATCH)]  # fmt: skip
    env = {**os.environ, "RAY_DEDUP_LOGS": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
    ran = run_process(cmd, workdir, env)
    line = next((s for s in reversed(ran.stdout.splitlines()) if s.startswith("{")), "")
    if ran.returncode != 0 or not line:
        return {"error": (ran.stderr or ran.stdout)[-2000:]}
    got = json.loads(line)
    stamps = got["stamps"]
    if len(stamps) != rounds + 1 or any(s[2] != clients for s in stamps):
        return {"error": f"Flower's rounds did not fit every client: {stamps}"}
    ends = [s[1] for s in stamps]
    return {
        **best_and_median([b - a for a, b in itertools.pairwise(ends)]),
        "first_round_seconds": ends[0] - got["start"],
        "peak_rss_bytes": ran.peak_rss_bytes,
        "note": "the driver and every process below it (Ray's workers) at once",
        "flwr": got["flwr"],
    }


# --- the run ---------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def measure(
    clients: int, plan: Plan, flower: str | None, devices: str, workdir: Path
) -> dict[str, Any]:
    rounds = plan.rounds.get(clients, 1)
    row: dict[str, Any] = {"clients": clients, "timed_rounds": rounds}
    print(f"C = {clients}: flotilla ...", file=sys.stderr, flush=True)
    row["flotilla"] = run_flotilla(clients, rounds, workdir, devices)
    print(f"C = {clients}: bare loop ...", file=sys.stderr, flush=True)
    row["loop"] = run_loop(clients, rounds, plan.loop_sample, workdir)
    if flower:
        print(f"C = {clients}: Flower ...", file=sys.stderr, flush=True)
        row["flower"] = run_flower(flower, clients, rounds, workdir)
    ours = row["flotilla"].get("seconds")
    row["speedup_vs_loop"] = ratio(row["loop"].get("seconds"), ours)
    row["speedup_vs_flower"] = ratio(row.get("flower", {}).get("seconds"), ours)
    return row


def report(plan: Plan, mode: str, flower: str | None, devices: str) -> dict[str, Any]:
    load = [list(os.getloadavg())]
    rows = []
    with tempfile.TemporaryDirectory(prefix="flotilla-h2h-") as tmp:
        for clients in plan.sizes:
            rows.append(measure(clients, plan, flower, devices, Path(tmp)))
    load.append(list(os.getloadavg()))
    by_size = {r["clients"]: r for r in rows}
    floors = []

    def floor(name: str, value: float | None, limit: float, at_most: bool) -> None:
        ok = value is not None and (value <= limit if at_most else value >= limit)
        floors.append({"name": name, "value": value, "limit": limit, "ok": ok})

    floor(
        f"speedup_vs_loop C={FLOOR_CLIENTS}",
        by_size.get(FLOOR_CLIENTS, {}).get("speedup_vs_loop"),
        SPEEDUP_LIMIT,
        at_most=False,
    )
    rss = {c: r["flotilla"].get("peak_rss_bytes") for c, r in by_size.items()}
    floor("rss_10k_vs_1k", ratio(rss.get(10_000), rss.get(1000)), RSS_LIMIT, at_most=True)
    return {
        "benchmark": "flower_h2h",
        "mode": mode,
        "revision": revision(),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average": {"start": load[0], "end": load[1]},
        },
        "workload": {
            "task": "examples/own_task/flower_mlp.py:FlowerMLP",
            "model": "MLP 784-128-10, 101,770 parameters",
            "samples_per_client": 50,
            "optimizer": f"SGD lr {LEARNING_RATE}, no momentum, batch {BATCH}, 1 epoch",
            "aggregation": "FedAvg over every client each round",
        },
        "plan": {"sizes": list(plan.sizes), "timed_rounds": plan.rounds},
        "flower": flower,
        "devices": devices,
        "sizes": rows,
        "floors": floors,
        "self_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def summary(result: dict[str, Any]) -> str:
    parts = []
    for row in result["sizes"]:
        ours = row["flotilla"].get("seconds")
        loop = row["loop"].get("seconds")
        shown = f"C={row['clients']}: flotilla {ours} s, loop {loop} s"
        if "flower" in row:
            shown += f", flower {row['flower'].get('seconds')} s"
        parts.append(shown)
    failed = [f["name"] for f in result["floors"] if not f["ok"]]
    return "; ".join(parts) + f"; floors not met: {failed or 'none'}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds; the loop sampled")
    parser.add_argument("--sizes", default=None, help="client counts, e.g. 1000,10000")
    parser.add_argument("--flower-python", default=None, metavar="PY",
                        help="a Python with flwr[simulation]: run Flower too")  # fmt: skip
    parser.add_argument("--devices", default="cpu",
                        help="where flotilla trains: cpu, or cuda:0 for one GPU")  # fmt: skip
    parser.add_argument("--bare-loop", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--trained", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bare_loop is not None:  # the loop's own process
        got = bare_loop(args.bare_loop, args.trained or args.bare_loop, args.rounds or 1)
        print(json.dumps(got))
        return 0
    plan = QUICK if args.quick else FULL
    if args.sizes:
        sizes = tuple(int(s) for s in args.sizes.split(","))
        plan = Plan(sizes, {c: plan.rounds.get(c, 1) for c in sizes}, plan.loop_sample)
    result = report(plan, "quick" if args.quick else "full", args.flower_python, args.devices)
    print(json.dumps(result, indent=2))
    print(summary(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
