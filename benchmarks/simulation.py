#!/usr/bin/env python
"""Simulation benchmark: one round of C virtual clients through ``flotilla simulate``
against bare PyTorch doing the same local training, all in one run on one machine.

The work, for C = 100, 1,000 and 10,000 clients: the digits MLP (64-256-128-10, 50,826
parameters, ``flotilla.tasks.digits:DigitsTask``), each client with 50 augmented samples
(``data.params = {augment, min_samples = max_samples = 50}``, of which the task keeps 5
for the client's validation split, so 45 are trained on: one batch of 32 and one of 13),
batch 32, 1 local epoch, SGD with lr 0.05 and momentum 0.9, starting from one global model.

``--workload flower`` runs Flower's simulation benchmark instead: its MLP 784-128-10
(101,770 parameters, ``examples/own_task/flower_mlp.py``), 50 synthetic examples per client,
all trained on (one batch of 32, one of 18), plain SGD with lr 0.1 and no momentum.

Four ways to do it, each measured here in the same run:

- ``flotilla``: a temporary experiment file (one job, ``clients_per_round = min_quorum =
  population.clients = C``, no over-selection, no dropout, always online, FedAvg, no
  compression) run by :func:`flotilla.simulation.run_experiment` -- what ``flotilla
  simulate`` calls -- in this process, for 1 + R rounds. A round's time is the difference
  of ``wall_seconds`` between consecutive rows of ``metrics.jsonl``: selection, the
  batched (``vmap``) training of all C clients, each client's validation, the update
  pipeline, the events on the virtual clock, FedAvg over C updates, the checkpoint, the
  server's held-out evaluation and the metrics rows. Round 1 also loads every client's
  data and warms up, so it is reported apart and not timed.
- ``loop``: a bare per-client PyTorch loop: for each client, the global weights copied
  into one reused model, a fresh ``torch.optim.SGD``, one epoch over its samples in
  batches of 32 (order ``torch.randperm``), the delta (local minus global) kept.
  At C > ``--loop-sample`` it runs on that many clients and is scaled by C / sample.
- ``loop1``: the same per-client loop with ``torch.set_num_threads(1)``, as Flower's
  benchmark runs each client: flotilla, on every core, must beat it by 1.5x (digits) and
  2.5x (Flower's MLP) at C = 1,000 (``speedup_vs_loop1``, value >= limit).
- ``vmap``: a bare ``torch.func`` loop over the same work: every client's parameters
  stacked, ``vmap(grad(loss))`` over clients per batch, SGD with momentum by hand, the
  stacked deltas returned; in groups of the size flotilla's ``BatchedTrainer`` uses.

The baselines' data is loaded beforehand (``ShardCache``, the same shards flotilla trains
on) and stacked into tensors; neither counts in their timings. They compute no metrics.
The machine may be shared, so the baselines alternate, half their repeats before
flotilla's run and half after, and each figure is the best of its runs (medians beside).

Floors (reported, never an exit status):

- at C = 1,000: flotilla round <= 1.5 x the bare vmap loop (``round_vs_vmap``, value <=
  limit) and >= 8 x faster than the bare per-client loop (``speedup_vs_loop``, value >=
  limit);
- at every C: simulator overhead per client per round, ``(flotilla - vmap) / C``, <= 50
  microseconds (``overhead_us_per_client``, value <= limit).

Stdout carries exactly one JSON object; a one-line summary goes to stderr.

    python benchmarks/simulation.py --quick     # C = 100 and 1,000: about 30 s on 2 cores
    python benchmarks/simulation.py --quick --workload flower
    python benchmarks/simulation.py             # C = 100, 1,000 and 10,000: 2-4 minutes
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from provenance import revision  # benchmarks/ is the script's sys.path[0]
from torch import nn

from flotilla.core.spec import DataSection, TrainSection
from flotilla.simulation import BatchedTrainer, ShardCache, load_experiment, run_experiment
from flotilla.tasks import Task, importable_from, load_task

#: Where Flower's MLP task lives (docs/simulation.md#bring-your-own-task).
TASK_DIR = Path(__file__).resolve().parents[1] / "examples" / "own_task"
#: Floors from the issues.
FLOOR_CLIENTS = 1000
VMAP_RATIO_LIMIT = 1.5
LOOP_SPEEDUP_LIMIT = 8.0
OVERHEAD_LIMIT_US = 50.0
#: Against the bare loop on one thread, by workload (issue 19).
LOOP1_SPEEDUP_LIMIT = {"digits": 1.5, "flower": 2.5}

log = logging.getLogger("benchmarks.simulation")


@dataclass(frozen=True)
class Workload:
    """What every client does in a round, the same for flotilla and every baseline."""

    name: str = "digits"
    task: str = "flotilla.tasks.digits:DigitsTask"
    samples: int = 50
    batch_size: int = 32
    local_epochs: int = 1
    learning_rate: float = 0.05
    momentum: float = 0.9
    alpha: float = 0.5
    seed: int = 0

    @property
    def data_params(self) -> dict[str, Any]:
        """The digits task's augmented shards of ``samples`` each; Flower's task has 50."""
        if self.name != "digits":
            return {}
        return {"augment": True, "min_samples": self.samples, "max_samples": self.samples}

    @property
    def data(self) -> DataSection:
        return DataSection(alpha=self.alpha, seed=self.seed, params=self.data_params)

    def load_task(self) -> Task:
        with importable_from([TASK_DIR]):
            return load_task(self.task)

    @property
    def train(self) -> TrainSection:
        return TrainSection(
            local_epochs=self.local_epochs,
            batch_size=self.batch_size,
            learning_rate=self.learning_rate,
            momentum=self.momentum,
        )


WORKLOADS = {
    "digits": Workload(),
    # Flower's simulation benchmark: 50 examples a client, all trained on, plain SGD at 0.1.
    "flower": Workload(name="flower", task="flower_mlp:FlowerMLP", learning_rate=0.1, momentum=0.0),
}


@dataclass(frozen=True)
class Plan:
    sizes: tuple[int, ...]
    #: Timed flotilla rounds per C (after one untimed warm-up round), by C.
    rounds: dict[int, int]
    #: Timed repeats of each baseline (the vmap loop also gets one untimed warm-up).
    repeats: int
    #: The per-client loop runs on at most this many clients and is scaled to C.
    loop_sample: int


QUICK = Plan(sizes=(100, 1000), rounds={100: 3, 1000: 3}, repeats=3, loop_sample=1000)
FULL = Plan(
    sizes=(100, 1000, 10_000),
    rounds={100: 5, 1000: 5, 10_000: 3},
    repeats=5,
    loop_sample=1000,
)
#: Thread settings that change every timing here (BLAS threads also run FedAvg's folds).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")

#: What each number includes: printed with the results.
INCLUDES = {
    "flotilla_round_seconds": (
        "best (least) over the timed rounds of the wall_seconds difference between consecutive "
        "metrics.jsonl rows of run_experiment (what `flotilla simulate` runs), in-process: "
        "selection, batched training of C clients, their validation, update pipeline, "
        "virtual-clock events, FedAvg of C updates, checkpoint, server held-out evaluation, "
        "metrics rows. Excludes process start, imports, data loading (round 1)."
    ),
    "flotilla_first_round_seconds": (
        "run start to the round-1 row: trainer setup, loading every client's data, warm-up"
    ),
    "flotilla_run_seconds": "the whole run_experiment call, plots and summary included",
    "vmap_seconds": (
        "best of the bare vmap(grad) loop over all C clients: stacking the global "
        "parameters per client, batch orders, forward/backward, SGD-with-momentum by hand, "
        "deltas as stacked tensors. Excludes data loading and stacking, and metrics."
    ),
    "loop1_seconds": "the same per-client loop with torch.set_num_threads(1)",
    "speedup_vs_loop1": "loop1_seconds / flotilla_round_seconds",
    "loop_seconds": (
        "the bare per-client loop (weights copied into one reused model, fresh "
        "torch.optim.SGD, randperm, forward/backward/step per batch, delta kept), best "
        "of its repeats on loop_sample_clients clients, scaled by C / loop_sample_clients. "
        "Excludes data loading, and metrics."
    ),
    "baseline_data_seconds": "loading and stacking the baselines' data (not in any timing)",
    "overhead_us_per_client": "(flotilla_round_seconds - vmap_seconds) / C, in microseconds",
    "round_vs_vmap": "flotilla_round_seconds / vmap_seconds",
    "speedup_vs_loop": "loop_seconds / flotilla_round_seconds",
    "vmap_speedup_vs_loop": "loop_seconds / vmap_seconds: the most any vmap path can gain here",
    "*_median_seconds, median_ratios": "the same from medians instead of best runs",
    "*_runs": "every timed run (loop_runs already scaled to C)",
}


# --- the data ------------------------------------------------------------------------------


@dataclass
class Clients:
    """Every client's training examples, stacked: ``x`` (C, n, 64), ``y`` (C, n)."""

    x: torch.Tensor
    y: torch.Tensor
    load_seconds: float


def load_clients(count: int, work: Workload) -> Clients:
    """The shards flotilla trains on (``ShardCache(task, count)``), equal sizes stacked."""
    start = time.perf_counter()
    cache = ShardCache(work.load_task(), count)
    data = work.data
    parts = [cache.get(data, i).train for i in range(count)]
    sizes = {int(y.shape[0]) for _, y in parts}
    if len(sizes) != 1:
        raise RuntimeError(f"clients differ in size: {sorted(sizes)}")
    x = torch.stack([x for x, _ in parts])
    y = torch.stack([y for _, y in parts])
    return Clients(x, y, time.perf_counter() - start)


def global_params(work: Workload) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    model = work.load_task().build_model(work.seed)
    return model, {n: p.detach().clone() for n, p in model.named_parameters()}


# --- baselines -----------------------------------------------------------------------------


def bare_loop(
    model: nn.Module,
    base: dict[str, torch.Tensor],
    clients: Clients,
    count: int,
    work: Workload,
    orders: torch.Tensor | None = None,
) -> list[list[torch.Tensor]]:
    """The first ``count`` clients one after another; each client's deltas."""
    params = list(model.parameters())
    start_values = list(base.values())
    loss_fn = nn.CrossEntropyLoss()
    n = clients.x.shape[1]
    deltas = []
    model.train()
    for c in range(count):
        with torch.no_grad():
            for p, g in zip(params, start_values, strict=True):
                p.copy_(g)
        opt = torch.optim.SGD(params, lr=work.learning_rate, momentum=work.momentum)
        x, y = clients.x[c], clients.y[c]
        gen = torch.Generator().manual_seed(c)
        for _ in range(work.local_epochs):
            order = torch.randperm(n, generator=gen) if orders is None else orders[c]
            for start in range(0, n, work.batch_size):
                idx = order[start : start + work.batch_size]
                loss = loss_fn(model(x[idx]), y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        with torch.no_grad():
            deltas.append([p - g for p, g in zip(params, start_values, strict=True)])
    return deltas


def bare_vmap(
    model: nn.Module,
    base: dict[str, torch.Tensor],
    clients: Clients,
    group: int,
    work: Workload,
    orders: torch.Tensor | None = None,
) -> list[dict[str, torch.Tensor]]:
    """All clients, ``group`` at a time as one vectorized computation; stacked deltas."""
    from torch.func import functional_call, grad, vmap

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(functional_call(model, p, (x,)), y)

    step = vmap(grad(loss_fn))
    total, n = clients.x.shape[0], clients.x.shape[1]
    gen = torch.Generator().manual_seed(0)
    out = []
    for first in range(0, total, group):
        x, y = clients.x[first : first + group], clients.y[first : first + group]
        count = x.shape[0]
        params = {k: v.expand(count, *v.shape).clone() for k, v in base.items()}
        bufs: dict[str, torch.Tensor] = {}
        rows = torch.arange(count).unsqueeze(1)
        for _ in range(work.local_epochs):
            if orders is None:
                order = torch.argsort(torch.rand(count, n, generator=gen), dim=1)
            else:
                order = orders[first : first + count]
            for start in range(0, n, work.batch_size):
                idx = order[:, start : start + work.batch_size]
                grads = step(params, x[rows, idx], y[rows, idx])
                for k, g in grads.items():
                    buf = bufs.get(k)
                    if buf is None:
                        bufs[k] = buf = g
                    else:
                        buf.mul_(work.momentum).add_(g)
                    params[k].add_(buf, alpha=-work.learning_rate)
        out.append({k: params[k].sub_(base[k]) for k in base})
    return out


def vmap_group(clients: Clients, work: Workload, params: int) -> int:
    """Clients per vectorized group: what flotilla's ``BatchedTrainer`` picks on the CPU."""
    task = work.load_task()
    trainer = BatchedTrainer(task, ShardCache(task, 1), "cpu")
    return trainer.group_size(work.train, params, int(clients.x[0, 0].numel()))


def check_baselines(
    model: nn.Module, base: dict[str, torch.Tensor], clients: Clients, work: Workload
) -> float | None:
    """Largest difference between the two baselines' deltas on a few clients given the
    same batch orders: they do the same arithmetic."""
    if work.local_epochs != 1:
        return None  # one order per client covers one epoch only
    count = min(8, clients.x.shape[0])
    few = Clients(clients.x[:count], clients.y[:count], 0.0)
    gen = torch.Generator().manual_seed(1)
    orders = torch.stack([torch.randperm(few.x.shape[1], generator=gen) for _ in range(count)])
    looped = bare_loop(model, base, few, count, work, orders)
    (stacked,) = bare_vmap(model, base, few, count, work, orders)
    diff = 0.0
    for c, deltas in enumerate(looped):
        for d, k in zip(deltas, base, strict=True):
            diff = max(diff, float((d - stacked[k][c]).abs().max()))
    return diff


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# --- flotilla ------------------------------------------------------------------------------

EXPERIMENT = """\
# Written by benchmarks/simulation.py: rounds of all {clients} clients, no dropout.
[job]
name = "bench-{clients}"
task = "{task}"
rounds = {rounds}
clients_per_round = {clients}
over_selection = 1.0
min_quorum = {clients}
round_deadline_s = 86400.0
seed = {seed}

[train]
local_epochs = {epochs}
batch_size = {batch}
learning_rate = {lr}
momentum = {momentum}

[data]
alpha = {alpha}
seed = {seed}
params = {data_params}

[aggregation]
strategy = "fedavg"

[compression]
uplink = "none"

[population]
clients = {clients}
dropout = 0.0

[population.availability]
kind = "always"

[simulation]
seed = {seed}
"""


def toml_table(values: dict[str, Any]) -> str:
    """An inline TOML table of scalars."""
    return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in values.items()) + " }"


def experiment_text(clients: int, rounds: int, work: Workload) -> str:
    return EXPERIMENT.format(
        clients=clients,
        task=work.task,
        rounds=rounds,
        seed=work.seed,
        epochs=work.local_epochs,
        batch=work.batch_size,
        lr=work.learning_rate,
        momentum=work.momentum,
        alpha=work.alpha,
        data_params=toml_table(work.data_params),
    )


def run_flotilla(clients: int, timed_rounds: int, work: Workload, workdir: Path) -> dict[str, Any]:
    path = workdir / f"bench-{clients}.toml"
    path.write_text(experiment_text(clients, timed_rounds + 1, work))
    out = workdir / f"out-{clients}"
    start = time.perf_counter()
    experiment = load_experiment(path)
    experiment = dataclasses.replace(experiment, task_dirs=(TASK_DIR,))
    summary = run_experiment(experiment, out, progress=False, plots=False)
    run_s = time.perf_counter() - start
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    if len(rows) != timed_rounds + 1:
        raise RuntimeError(f"expected {timed_rounds + 1} rounds, metrics.jsonl has {len(rows)}")
    short = [r["round"] for r in rows if r["participants"] != clients or r["dropouts"]]
    if short:
        raise RuntimeError(f"rounds {short} did not train all {clients} clients")
    walls = [r["wall_seconds"] for r in rows]
    rounds = [b - a for a, b in itertools.pairwise(walls)]
    return {
        "flotilla_round_seconds": min(rounds),
        "flotilla_round_median_seconds": statistics.median(rounds),
        "flotilla_round_runs": rounds,
        "flotilla_first_round_seconds": walls[0],
        "flotilla_run_seconds": run_s,
        "flotilla_trainer": summary.get("trainer", {}),
        "flotilla_accuracy": [r.get("accuracy") for r in rows],
    }


# --- the run -------------------------------------------------------------------------------


def measure(clients: int, plan: Plan, work: Workload, workdir: Path) -> dict[str, Any]:
    model, base = global_params(work)
    data = load_clients(clients, work)
    params = sum(v.numel() for v in base.values())
    group = vmap_group(data, work, params)
    sample = min(clients, plan.loop_sample)

    def vmap_once() -> None:
        bare_vmap(model, base, data, group, work)

    def loop_once() -> None:
        bare_loop(model, base, data, sample, work)

    def loop1_once() -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            bare_loop(model, base, data, sample, work)
        finally:
            torch.set_num_threads(threads)

    # The machine is shared: the baselines alternate, half their repeats before
    # flotilla's run and half after, so a burst of other work is likely to hit each side;
    # and every figure is the best of its runs (the least disturbed one), medians beside.
    vmap_once()  # warm-up, not counted
    bare_loop(model, base, data, min(sample, 50), work)
    vmap_runs: list[float] = []
    loop_runs: list[float] = []
    loop1_runs: list[float] = []

    def baselines(repeats: int) -> None:
        for _ in range(repeats):
            vmap_runs.append(timed(vmap_once))
            loop_runs.append(timed(loop_once) * clients / sample)
            loop1_runs.append(timed(loop1_once) * clients / sample)

    before = (plan.repeats + 1) // 2
    baselines(before)
    result = run_flotilla(clients, plan.rounds.get(clients, 2), work, workdir)
    baselines(plan.repeats - before)

    vmap_s, loop_s, loop1_s = min(vmap_runs), min(loop_runs), min(loop1_runs)
    round_s = result["flotilla_round_seconds"]
    return {
        "clients": clients,
        "samples_per_client": work.samples,
        "train_samples_per_client": int(data.x.shape[1]),
        "steps_per_client": work.local_epochs * math.ceil(data.x.shape[1] / work.batch_size),
        "model_params": params,
        **result,
        "vmap_seconds": vmap_s,
        "vmap_median_seconds": statistics.median(vmap_runs),
        "vmap_runs": vmap_runs,
        "vmap_group_clients": group,
        "loop_seconds": loop_s,
        "loop1_seconds": loop1_s,
        "loop1_median_seconds": statistics.median(loop1_runs),
        "loop1_runs": loop1_runs,
        "speedup_vs_loop1": loop1_s / round_s,
        "loop_median_seconds": statistics.median(loop_runs),
        "loop_runs": loop_runs,
        "loop_scaled": sample < clients,
        "loop_sample_clients": sample,
        "baseline_data_seconds": data.load_seconds,
        "baseline_check_max_abs_diff": check_baselines(model, base, data, work),
        "round_vs_vmap": round_s / vmap_s,
        "speedup_vs_loop": loop_s / round_s,
        "vmap_speedup_vs_loop": loop_s / vmap_s,
        "overhead_us_per_client": (round_s - vmap_s) / clients * 1e6,
        "median_ratios": {
            "round_vs_vmap": result["flotilla_round_median_seconds"] / statistics.median(vmap_runs),
            "speedup_vs_loop": statistics.median(loop_runs)
            / result["flotilla_round_median_seconds"],
        },
        "us_per_client": {
            "flotilla": round_s / clients * 1e6,
            "vmap": vmap_s / clients * 1e6,
            "loop": loop_s / clients * 1e6,
        },
    }


@dataclass
class Report:
    mode: str
    plan: Plan
    work: Workload
    load: list[list[float]] = field(default_factory=lambda: [list(os.getloadavg())])
    #: Taken at the start: the code measured is the code imported then.
    revision: dict[str, Any] = field(default_factory=lambda: revision())
    sizes: list[dict[str, Any]] = field(default_factory=list)
    floors: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def floor(self, name: str, value: float | None, limit: float, at_most: bool = True) -> None:
        ok = value is not None and (value <= limit if at_most else value >= limit)
        self.floors.append({"name": name, "value": value, "limit": limit, "ok": ok})

    def add(self, row: dict[str, Any]) -> None:
        self.sizes.append(row)
        c = row["clients"]
        if "error" in row:
            self.floor(f"overhead_us_per_client C={c}", None, OVERHEAD_LIMIT_US)
        else:
            self.floor(
                f"overhead_us_per_client C={c}", row["overhead_us_per_client"], OVERHEAD_LIMIT_US
            )
        if c == FLOOR_CLIENTS:
            self.floor(
                f"speedup_vs_loop1 C={c}",
                row.get("speedup_vs_loop1"),
                LOOP1_SPEEDUP_LIMIT[self.work.name],
                at_most=False,
            )
            self.floor(f"round_vs_vmap C={c}", row.get("round_vs_vmap"), VMAP_RATIO_LIMIT)
            self.floor(
                f"speedup_vs_loop C={c}",
                row.get("speedup_vs_loop"),
                LOOP_SPEEDUP_LIMIT,
                at_most=False,
            )

    def to_json(self) -> dict[str, Any]:
        if FLOOR_CLIENTS not in self.plan.sizes:
            self.notes.append(f"C = {FLOOR_CLIENTS} not run: its two ratio floors are missing")
        return {
            "benchmark": "simulation",
            "mode": self.mode,
            "machine": {
                "cpus": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
                "thread_variables": {k: os.environ.get(k) for k in THREAD_VARIABLES},
                "python": platform.python_version(),
                "torch": torch.__version__,
                "platform": platform.platform(),
                "load_average": {"start": self.load[0], "end": list(os.getloadavg())},
            },
            "workload": asdict(self.work),
            "plan": {
                "sizes": list(self.plan.sizes),
                "timed_rounds": {str(k): v for k, v in self.plan.rounds.items()},
                "baseline_repeats": self.plan.repeats,
                "loop_sample": self.plan.loop_sample,
            },
            "includes": INCLUDES,
            "floor_limits": {
                "round_vs_vmap": f"<= {VMAP_RATIO_LIMIT} at C = {FLOOR_CLIENTS}",
                "speedup_vs_loop": f">= {LOOP_SPEEDUP_LIMIT} at C = {FLOOR_CLIENTS}",
                "speedup_vs_loop1": (
                    f">= {LOOP1_SPEEDUP_LIMIT[self.work.name]} at C = {FLOOR_CLIENTS}"
                ),
                "overhead_us_per_client": f"<= {OVERHEAD_LIMIT_US} at every C",
            },
            "revision": self.revision,
            "sizes": self.sizes,
            "floors": self.floors,
            "notes": self.notes,
        }


def run(plan: Plan, mode: str, work: Workload, keep: bool = False) -> Report:
    report = Report(mode, plan, work)
    workdir = Path(tempfile.mkdtemp(prefix="flotilla-simbench-"))
    try:
        for clients in plan.sizes:
            log.warning("C = %d", clients)
            try:
                row = measure(clients, plan, work, workdir)
            except Exception as exc:  # report it, go on with the other sizes
                log.exception("C = %d failed", clients)
                row = {"clients": clients, "error": repr(exc)}
            report.add(row)
            if row.get("loop_scaled"):
                report.notes.append(
                    f"C = {clients}: the per-client loop ran on {row['loop_sample_clients']} "
                    f"clients and was scaled by {clients / row['loop_sample_clients']:g}"
                )
            if not keep:
                shutil.rmtree(workdir / f"out-{clients}", ignore_errors=True)
    finally:
        if keep:
            log.warning("kept %s", workdir)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return report


def summary(report: Report) -> str:
    parts = []
    for row in report.sizes:
        if "error" in row:
            parts.append(f"C={row['clients']}: ERROR")
            continue
        parts.append(
            f"C={row['clients']}: flotilla {row['flotilla_round_seconds']:.3f}s, "
            f"vmap {row['vmap_seconds']:.3f}s, loop {row['loop_seconds']:.2f}s, "
            f"one-thread loop {row['loop1_seconds']:.2f}s "
            f"({row['round_vs_vmap']:.2f}x vmap, {row['speedup_vs_loop']:.1f}x faster than "
            f"loop, overhead {row['overhead_us_per_client']:.0f} us/client)"
        )
    failed = [f["name"] for f in report.floors if not f["ok"]]
    ok = len(report.floors) - len(failed)
    tail = f"floors {ok}/{len(report.floors)} ok" + (
        f" (failed: {', '.join(failed)})" if failed else ""
    )
    return "simulation: " + "; ".join(parts) + "; " + tail


def parse_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("want client counts >= 1, e.g. 100,1000")
    return sizes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="C = 100 and 1,000, fewer repeats")
    parser.add_argument("--sizes", type=parse_sizes, default=None, help="client counts, e.g. 1000")
    parser.add_argument("--rounds", type=int, default=None, help="timed flotilla rounds per C")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per baseline")
    parser.add_argument(
        "--loop-sample", type=int, default=None, help="clients the per-client loop runs on"
    )
    parser.add_argument("--keep", action="store_true", help="keep the experiment files and output")
    parser.add_argument("--json-only", action="store_true", help="no summary line on stderr")
    parser.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="digits",
        help="the digits MLP, or Flower's MLP 784-128-10 (examples/own_task)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("flotilla").setLevel(logging.WARNING)
    base = QUICK if args.quick else FULL
    sizes = args.sizes or base.sizes
    rounds = {c: args.rounds or base.rounds.get(c, 2) for c in sizes}
    plan = Plan(
        sizes=sizes,
        rounds=rounds,
        repeats=max(1, args.repeats or base.repeats),
        loop_sample=max(1, args.loop_sample or base.loop_sample),
    )
    custom = args.sizes or args.rounds or args.repeats or args.loop_sample
    mode = "custom" if custom else "quick" if args.quick else "full"
    report = run(plan, mode, WORKLOADS[args.workload], args.keep)
    print(json.dumps(report.to_json(), indent=2))
    if not args.json_only:
        print(summary(report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
