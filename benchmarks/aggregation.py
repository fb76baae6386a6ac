#!/usr/bin/env python
"""Aggregation benchmark: every strategy folding many updates of a 10M-parameter model.

Each (rule, update count) runs in a fresh subprocess, so peak resident memory is measured
per rule: the worker builds the model and the update source, imports and warms up
everything it will use, records its RSS as the baseline, resets the kernel's peak counter
(``/proc/self/clear_refs``), aggregates one round (``begin``, ``add`` x N, ``finalize``)
and reports ``VmHWM - baseline``.

Updates are not held in RAM: four random float32 buffers are generated once and update
``i`` is ``base[i % 4] * s_i`` written into one reused buffer (outside the timed region).
The baseline is a bare ``torch.Tensor.add_`` loop over the same buffers and weights, in
the same run. The package under test never imports torch; only this benchmark does.

Floors (reported, never an exit status):

- memory: FedAvg, FedAvgM, FedAdam, FedYogi and FedAdagrad peak RSS above the baseline
  stays under ``3 x model_bytes + 64 MiB`` at two update counts, and the two peaks differ
  by at most 4 MiB (memory does not grow with the number of updates);
- speed: FedAvg's updates/s is at least 50% of the torch ``add_`` loop's.

Stdout carries exactly one JSON object; a one-line summary per run goes to stderr.

    python benchmarks/aggregation.py --quick    # 10M params; 30/120 updates, robust 24
    python benchmarks/aggregation.py            # 10M params; 50/200 updates for every rule
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

MiB = 1 << 20
MEMORY_CONSTANT_BYTES = 64 * MiB
MEMORY_MODEL_FACTOR = 3.0
#: Peak RSS may differ by this much between the two update counts (allocator noise).
GROWTH_LIMIT_BYTES = 4 * MiB
SPEED_RATIO = 0.5
SOURCE_BUFFERS = 4
STREAMING = ("fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad")
MEMORY_FLOOR_RULES = ("fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad")
ROBUST = ("median", "trimmed_mean", "krum", "multikrum", "centered_clipping")
OTHER = ("dp_fedavg", "fedbuff")
RULE_PARAMS: dict[str, dict[str, Any]] = {
    "krum": {"f": 2},
    "multikrum": {"f": 2},
    "trimmed_mean": {"beta": 0.1},
    "dp_fedavg": {"epsilon": 1e6},
    "fedbuff": {"buffer_size": 10},
}


# --- worker: one rule, one round, in its own process -------------------------------------


def _layout_and_model(params: int) -> tuple[tuple[Any, ...], dict[str, np.ndarray]]:
    from flotilla.core.tensors import state_spec

    rng = np.random.default_rng(0)
    bias = min(1000, params // 10)
    model = {
        "w": rng.standard_normal(params - bias, dtype=np.float32),
        "b": rng.standard_normal(bias, dtype=np.float32),
    }
    return state_spec(model), model


class _Source:
    """Update ``i`` = ``base[i % 4] * scale_i``, written into one reused buffer."""

    def __init__(self, model: dict[str, np.ndarray]) -> None:
        rng = np.random.default_rng(1)
        self.bases = [
            {k: (0.01 * rng.standard_normal(v.shape, dtype=np.float32)) for k, v in model.items()}
            for _ in range(SOURCE_BUFFERS)
        ]
        self.buf = {k: np.zeros_like(v) for k, v in model.items()}  # touched: in the baseline
        self.rng = rng

    def update(self, i: int) -> tuple[dict[str, np.ndarray], float]:
        scale = np.float32(0.5 + self.rng.random())
        for k, out in self.buf.items():
            np.multiply(self.bases[i % SOURCE_BUFFERS][k], scale, out=out)
        return self.buf, float(self.rng.integers(1, 500))


class _Peak:
    """Peak RSS since ``start``: the kernel's VmHWM after clear_refs, else sampling."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.sampled = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.kernel = False

    def start(self) -> int:
        base = int(self.proc.memory_info().rss)
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.kernel = "VmHWM" in Path("/proc/self/status").read_text()
        except OSError:
            self.kernel = False
        if not self.kernel:
            self.sampled = base
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return base

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.sampled = max(self.sampled, int(self.proc.memory_info().rss))

    def stop(self) -> int:
        if self.kernel:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.sampled


def _worker_torch(params: int, updates: int) -> dict[str, Any]:
    import torch

    _, model = _layout_and_model(params)
    source = _Source(model)
    acc = {k: torch.zeros(v.shape) for k, v in model.items()}
    peak = _Peak()
    base = peak.start()
    spent = 0.0
    for i in range(updates):
        update, weight = source.update(i)
        t0 = time.perf_counter()
        for k, a in acc.items():
            a.add_(torch.from_numpy(update[k]), alpha=weight)
        spent += time.perf_counter() - t0
    return {
        "add_seconds": spent,
        "finalize_seconds": 0.0,
        "peak": peak.stop() - base,
        "torch_threads": torch.get_num_threads(),
    }


def _worker(rule: str, params: int, updates: int, spool: Path) -> dict[str, Any]:
    from flotilla.aggregation import DPFedAvg, FedBuff, make_aggregator

    layout, model = _layout_and_model(params)
    source = _Source(model)
    agg = make_aggregator(rule, RULE_PARAMS.get(rule, {}), layout, spool)
    # Warm up what the round will import (scipy's BLAS, dp_accounting) before the baseline.
    warm = make_aggregator("fedavg", {}, layout[-1:], None)
    warm.begin(0, {"b": model["b"]})
    warm.add({"b": model["b"]}, 1.0)
    warm.finalize()
    if isinstance(agg, DPFedAvg):
        agg.check_budget(0.01)
    peak = _Peak()
    base = peak.start()
    add_s = fin_s = 0.0
    commits = 0
    agg.begin(1, model)
    for i in range(updates):
        update, weight = source.update(i)
        t0 = time.perf_counter()
        if isinstance(agg, FedBuff):
            agg.add(update, weight, staleness=i % 3)
            if agg.ready():
                agg.finalize()
                commits += 1
        else:
            agg.add(update, weight)
        add_s += time.perf_counter() - t0
    spool_bytes = sum(f.stat().st_size for f in spool.iterdir()) if spool.exists() else 0
    t0 = time.perf_counter()
    if agg.count:
        new = agg.finalize()
        commits += 1
        del new
    fin_s = time.perf_counter() - t0
    peak_bytes = peak.stop() - base
    left = list(spool.iterdir()) if spool.exists() else []
    agg.close()
    return {
        "add_seconds": add_s,
        "finalize_seconds": fin_s,
        "peak": peak_bytes,
        "spool_bytes": spool_bytes,
        "spool_files_left": len(left),
        "commits": commits,
    }


# --- driver ------------------------------------------------------------------------------


def _run(rule: str, params: int, updates: int, spool_root: Path) -> dict[str, Any]:
    spool = spool_root / f"{rule}-{updates}"
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        rule,
        "--params",
        str(params),
        "--updates",
        str(updates),
        "--spool",
        str(spool),
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    shutil.rmtree(spool, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {rule} x{updates} failed:\n{proc.stderr[-4000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    seconds = out["add_seconds"] + out["finalize_seconds"]
    entry = {
        "rule": rule,
        "updates": updates,
        "seconds": round(seconds, 4),
        "add_seconds": round(out["add_seconds"], 4),
        "finalize_seconds": round(out["finalize_seconds"], 4),
        "updates_per_s": round(updates / seconds, 2) if seconds else None,
        "peak_rss_bytes": out["peak"],
        "worker_wall_seconds": round(wall, 2),
    }
    entry.update(
        {k: v for k, v in out.items() if k not in ("add_seconds", "finalize_seconds", "peak")}
    )
    return entry


def _plan(few: int, many: int, robust: int) -> list[tuple[str, int]]:
    plan = [("torch_add", many)]
    plan += [(rule, many) for rule in STREAMING]
    plan += [(rule, few) for rule in MEMORY_FLOOR_RULES]
    plan += [(rule, many) for rule in OTHER]
    plan += [(rule, robust) for rule in ROBUST]
    return plan


def _floors(runs: list[dict[str, Any]], model_bytes: int) -> list[dict[str, Any]]:
    floors = []
    limit = MEMORY_MODEL_FACTOR * model_bytes + MEMORY_CONSTANT_BYTES
    for run in runs:
        if run["rule"] in MEMORY_FLOOR_RULES:
            floors.append(
                {
                    "name": f"peak_rss {run['rule']} x{run['updates']}",
                    "value": run["peak_rss_bytes"],
                    "limit": int(limit),
                    "ok": run["peak_rss_bytes"] <= limit,
                }
            )
    for rule in MEMORY_FLOOR_RULES:
        peaks = sorted((r["updates"], r["peak_rss_bytes"]) for r in runs if r["rule"] == rule)
        if len(peaks) >= 2:
            (n0, p0), (n1, p1) = peaks[0], peaks[-1]
            floors.append(
                {
                    "name": f"peak_rss_growth {rule} x{n0}->x{n1}",
                    "value": p1 - p0,
                    "limit": GROWTH_LIMIT_BYTES,
                    "ok": p1 - p0 <= GROWTH_LIMIT_BYTES,
                }
            )
    torch_run = next(r for r in runs if r["rule"] == "torch_add")
    fedavg = next(r for r in runs if r["rule"] == "fedavg" and r["updates"] == torch_run["updates"])
    ratio = fedavg["updates_per_s"] / torch_run["updates_per_s"]
    floors.append(
        {
            "name": "fedavg_vs_torch_add_throughput",
            "value": round(ratio, 3),
            "limit": SPEED_RATIO,
            "ok": ratio >= SPEED_RATIO,
        }
    )
    return floors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer updates (about a minute)")
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--updates", type=int, default=None, help="updates per streaming run")
    ap.add_argument("--robust-updates", type=int, default=None)
    ap.add_argument("--only", default="", help="comma-separated rules (torch_add is kept)")
    ap.add_argument("--spool", type=Path, default=None, help="spool directory (default: tmp)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        if args.worker == "torch_add":
            result = _worker_torch(args.params, args.updates)
        else:
            result = _worker(args.worker, args.params, args.updates, args.spool)
        print(json.dumps(result))
        return

    many = args.updates or (120 if args.quick else 200)
    few = max(2, many // 4)
    robust = args.robust_updates or (24 if args.quick else 200)
    plan = _plan(few, many, robust)
    if args.only:
        keep = {"torch_add", *args.only.split(",")}
        plan = [(r, n) for r, n in plan if r in keep]
    model_bytes = 4 * args.params
    root = Path(tempfile.mkdtemp(prefix="flotilla-aggbench-", dir=args.spool))
    runs = []
    try:
        for rule, n in plan:
            run = _run(rule, args.params, n, root)
            runs.append(run)
            print(
                f"{rule:>18} x{n:<4} {run['seconds']:8.3f} s  {run['updates_per_s']:8.1f} upd/s  "
                f"peak {run['peak_rss_bytes'] / MiB:8.1f} MiB",
                file=sys.stderr,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = {
        "benchmark": "aggregation",
        "quick": args.quick,
        "params": args.params,
        "model_bytes": model_bytes,
        "memory_limit": f"{MEMORY_MODEL_FACTOR:g} x model_bytes + {MEMORY_CONSTANT_BYTES} bytes "
        "above the RSS after imports and after generating the model and update source",
        "machine": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "runs": runs,
        "floors": _floors(runs, model_bytes) if any(r["rule"] == "fedavg" for r in runs) else [],
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
