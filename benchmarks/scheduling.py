#!/usr/bin/env python
"""Scheduling benchmark: every selector over many seeds, in two scenarios, paired by seed.

Each run is ``flotilla simulate`` (in this process) of ``examples/scheduling/SCENARIO.toml``
-- 1,000 devices with lognormal speed and bandwidth, exponential on/off sessions, 5 %
mid-round dropout, Dirichlet(0.5) labels, and three concurrent jobs with different
bottlenecks (``wide``: transfer, ``epochs``: compute, ``charlm``: the char LM) -- with
``scheduling.selector`` and ``simulation.seed`` set. The same seed gives every selector
the same fleet, sessions and data, so selectors are compared seed by seed.

Per run and job: simulated time to the job's target (held-out accuracy for the digits jobs,
bits per character for the char LM: :data:`TARGETS`), accuracy at fixed simulated-time
budgets, final accuracy and final target metric. Per run: Jain's fairness index of how many
updates each device contributed (all 1,000 devices, all jobs), the share of devices never
used, wasted device-hours (devices selected but not aggregated, times their round's length),
and the selector's CPU per decision (``wall_sched_cpu_s``, measured by the arbiter).

Speed-up of a selector over random, per seed: the geometric mean over the jobs of
``time_to_target(random) / time_to_target(selector)``. A job that never reaches the target
is charged its whole simulated time (so its speed-up is an optimistic bound, counted as
``censored``). Reported: the median over seeds with a 95 % bootstrap interval.

Floors (reported, never an exit status), from the issue:

``rl-pretrained`` is ``rl`` starting from a policy that ``flotilla simulate`` trained on
the same scenario with another seed (``PRETRAIN_SEED``, ``--pretrain-rounds`` rounds): the
pre-training a user would do before meeting real devices.

- unrelated: the best learned selector (rl, rl-pretrained or bayesian) reaches the target
  >= 1.5x faster than random (median speed-up), its final accuracy within 1 point of
  random's and its Jain index within 0.1 of random's;
- related: the best learned selector is no worse than 0.9x random;
- the best learned selector beats greedy by >= 1.2x;
- scheduler CPU per job-round under 50 ms (mean over every decision).

Stdout carries exactly one JSON object; a one-line summary goes to stderr.

    python benchmarks/scheduling.py --quick     # unrelated, 3 selectors, 2 seeds, short jobs
    python benchmarks/scheduling.py             # both scenarios, 7 selectors, 10 seeds
    python benchmarks/scheduling.py --workers 2 # the same, two runs at a time
"""

from __future__ import annotations

import argparse
import dataclasses
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
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from provenance import revision  # benchmarks/ is the script's sys.path[0]

from flotilla.scheduling import jain_index
from flotilla.simulation import load_experiment, run_experiment

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("unrelated", "related")
SELECTORS = ("random", "fedcs", "greedy", "oort", "rl", "rl-pretrained", "bayesian")
LEARNED = ("rl", "rl-pretrained", "bayesian")
PRETRAIN_ROUNDS = 120
#: The scenarios' job whose pre-trained rl policy ``rl-pretrained`` starts from.
PRETRAIN_JOB = "epochs"
BUDGETS_S = (300.0, 1000.0, 3000.0)
BOOTSTRAP = 2000

log = logging.getLogger("benchmarks.scheduling")


@dataclass(frozen=True)
class Target:
    """When a job counts as trained: a held-out metric at or past a threshold."""

    metric: str
    value: float
    higher_is_better: bool = True

    def reached(self, row: Mapping[str, Any]) -> bool:
        if self.metric not in row:
            return False
        got = float(row[self.metric])
        return got >= self.value if self.higher_is_better else got <= self.value

    def label(self) -> str:
        return f"{self.metric} {'>=' if self.higher_is_better else '<='} {self.value:g}"


#: Per job; ``*`` for the rest. The char LM's next-character accuracy stays near 0.25 in 40
#: rounds, so its target is bits per character: 4.25 is half a bit under the entropy of the
#: corpus's character frequencies (4.74 bits), so the model has learned what follows what.
TARGETS: Mapping[str, Target] = {
    "*": Target("accuracy", 0.80),
    "charlm": Target("bits_per_char", 4.25, higher_is_better=False),
}


@dataclass(frozen=True)
class Plan:
    scenarios: tuple[str, ...]
    selectors: tuple[str, ...]
    seeds: tuple[int, ...]
    targets: Mapping[str, Target]
    overrides: tuple[str, ...] = ()

    def target(self, job: str) -> Target:
        return self.targets.get(job, self.targets["*"])


FULL = Plan(SCENARIOS, SELECTORS, tuple(range(10)), TARGETS)
QUICK = Plan(
    ("unrelated",),
    ("random", "greedy", "bayesian"),
    (0, 1),
    {"*": Target("accuracy", 0.6), "charlm": Target("bits_per_char", 4.6, False)},
    ("job.rounds=10", "population.clients=400"),
)


#: Seed of the pre-training runs: none of the evaluation seeds.
PRETRAIN_SEED = 1000


def pretrain(scenario: str, plan: Plan, workdir: Path, rounds: int) -> Path:
    """An rl policy trained in simulation on another seed (:data:`PRETRAIN_JOB`'s), as a
    user would before meeting real devices: ``flotilla simulate`` writes it to selectors/."""
    path = ROOT / "examples" / "scheduling" / f"{scenario}.toml"
    overrides = [
        "scheduling.selector=rl",
        f"simulation.seed={PRETRAIN_SEED}",
        *plan.overrides,
        f"job.rounds={rounds}",
    ]
    out = workdir / f"pretrain-{scenario}"
    run_experiment(load_experiment(path, overrides), out, progress=False)
    policy = workdir / f"policy-{scenario}.json"
    shutil.copy(out / "selectors" / f"{PRETRAIN_JOB}.json", policy)
    shutil.rmtree(out, ignore_errors=True)
    return policy


def selector_overrides(selector: str, policies: dict[str, Path], scenario: str) -> list[str]:
    """``rl-pretrained`` is ``rl`` starting from the scenario's pre-trained policy."""
    if selector == "rl-pretrained":
        return ["scheduling.selector=rl", f"scheduling.params.policy_file={policies[scenario]}"]
    return [f"scheduling.selector={selector}"]


def run_one(
    scenario: str,
    selector: str,
    seed: int,
    plan: Plan,
    workdir: Path,
    policies: dict[str, Path] | None = None,
) -> dict[str, Any]:
    path = ROOT / "examples" / "scheduling" / f"{scenario}.toml"
    overrides = [
        *selector_overrides(selector, policies or {}, scenario),
        f"simulation.seed={seed}",
        *plan.overrides,
    ]
    experiment = load_experiment(path, overrides)
    out = workdir / f"{scenario}-{selector}-{seed}"
    started = time.perf_counter()
    run_experiment(experiment, out, progress=False)
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    parts = [json.loads(line) for line in (out / "participation.jsonl").read_text().splitlines()]
    shutil.rmtree(out, ignore_errors=True)
    jobs: dict[str, dict[str, Any]] = {}
    for name in sorted({r["job"] for r in rows}):
        mine = [r for r in rows if r["job"] == name]
        target = plan.target(name)
        reached = [r["simulated_time"] for r in mine if target.reached(r)]
        jobs[name] = {
            "target": target.label(),
            "time_to_target_s": min(reached) if reached else None,
            "simulated_s": mine[-1]["simulated_time"],
            "final_accuracy": mine[-1].get("accuracy"),
            f"final_{target.metric}": mine[-1].get(target.metric),
            "accuracy_at": {
                f"{b:.0f}": max(
                    [r.get("accuracy", 0.0) for r in mine if r["simulated_time"] <= b],
                    default=0.0,
                )
                for b in BUDGETS_S
            },
        }
    devices = experiment.population.clients
    counts = Counter(p["device"] for p in parts)
    per_device = np.array([counts.get(f"sim-{i:06d}", 0) for i in range(devices)], dtype=float)
    wasted = sum(
        max(r.get("sched_selected", 0.0) - r["participants"], 0.0) * r["round_seconds"]
        for r in rows
    )
    cpu = [r["wall_sched_cpu_s"] for r in rows if "wall_sched_cpu_s" in r]
    return {
        "scenario": scenario,
        "selector": selector,
        "seed": seed,
        "jobs": jobs,
        "jain": jain_index(per_device),
        "never_used": float(np.mean(per_device == 0)),
        "wasted_device_hours": wasted / 3600.0,
        "sched_cpu_ms_mean": 1e3 * statistics.fmean(cpu) if cpu else None,
        "sched_cpu_ms_max": 1e3 * max(cpu) if cpu else None,
        "wall_seconds": wall,
    }


def _time_to_target(run: dict[str, Any], job: str) -> tuple[float, bool]:
    """(seconds, censored): a job that never got there is charged all its time."""
    j = run["jobs"][job]
    if j["time_to_target_s"] is None:
        return float(j["simulated_s"]), True
    return float(j["time_to_target_s"]), False


def speedups(
    runs: list[dict[str, Any]], scenario: str, selector: str, baseline: str
) -> tuple[list[float], int]:
    """Per seed, geometric mean over jobs of baseline time / selector time; and how many
    job-seeds were censored for either."""
    by = {(r["selector"], r["seed"]): r for r in runs if r["scenario"] == scenario}
    out, censored = [], 0
    for (sel, seed), run in sorted(by.items()):
        if sel != selector or (baseline, seed) not in by:
            continue
        base = by[(baseline, seed)]
        logs = []
        for job in run["jobs"]:
            t_sel, c1 = _time_to_target(run, job)
            t_base, c2 = _time_to_target(base, job)
            censored += int(c1 or c2)
            logs.append(math.log(max(t_base, 1e-9) / max(t_sel, 1e-9)))
        out.append(math.exp(statistics.fmean(logs)))
    return out, censored


def bootstrap_median(values: Sequence[float], seed: int = 0) -> tuple[float, float]:
    if not values:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    v = np.asarray(values)
    meds = np.median(rng.choice(v, size=(BOOTSTRAP, len(v)), replace=True), axis=1)
    return float(np.quantile(meds, 0.025)), float(np.quantile(meds, 0.975))


def summarize(runs: list[dict[str, Any]], plan: Plan) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for scenario in plan.scenarios:
        table[scenario] = {}
        for selector in plan.selectors:
            mine = [r for r in runs if r["scenario"] == scenario and r["selector"] == selector]
            if not mine:
                continue
            jobs = sorted(mine[0]["jobs"])
            # Final accuracy over the jobs judged by accuracy (the char LM's is ~0.25 either
            # way); every job's own target metric separately.
            scored = [j for j in jobs if plan.target(j).metric == "accuracy"] or jobs
            ups, censored = speedups(runs, scenario, selector, "random")
            entry: dict[str, Any] = {
                "seeds": len(mine),
                "time_to_target_s": {
                    j: statistics.median(_time_to_target(r, j)[0] for r in mine) for j in jobs
                },
                "final_accuracy": statistics.median(
                    statistics.fmean(r["jobs"][j]["final_accuracy"] or 0.0 for j in scored)
                    for r in mine
                ),
                "final_target_metric": {
                    j: statistics.median(
                        r["jobs"][j].get(f"final_{plan.target(j).metric}") or math.nan for r in mine
                    )
                    for j in jobs
                },
                "jain": statistics.median(r["jain"] for r in mine),
                "never_used": statistics.median(r["never_used"] for r in mine),
                "wasted_device_hours": statistics.median(r["wasted_device_hours"] for r in mine),
                "sched_cpu_ms_mean": statistics.fmean(
                    r["sched_cpu_ms_mean"] for r in mine if r["sched_cpu_ms_mean"] is not None
                ),
                "speedup_vs_random": statistics.median(ups) if ups else None,
                "speedup_vs_random_ci95": bootstrap_median(ups),
                "censored_job_seeds": censored,
            }
            if "greedy" in plan.selectors and selector != "greedy":
                vs_greedy, _ = speedups(runs, scenario, selector, "greedy")
                entry["speedup_vs_greedy"] = statistics.median(vs_greedy) if vs_greedy else None
                entry["speedup_vs_greedy_ci95"] = bootstrap_median(vs_greedy)
            table[scenario][selector] = entry
    return table


def floors(table: dict[str, Any], plan: Plan) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def floor(name: str, value: float | None, limit: float, at_least: bool) -> None:
        ok = value is not None and (value >= limit if at_least else value <= limit)
        out.append({"name": name, "value": value, "limit": limit, "ok": ok})

    learned = [s for s in LEARNED if s in plan.selectors]
    for scenario, limit in (("unrelated", 1.5), ("related", 0.9)):
        rows = table.get(scenario, {})
        if not learned or "random" not in rows:
            continue
        best = max(learned, key=lambda s: rows[s]["speedup_vs_random"] or 0.0)
        floor(
            f"speedup_vs_random {scenario} ({best})", rows[best]["speedup_vs_random"], limit, True
        )
        if scenario == "unrelated":
            gap = rows[best]["final_accuracy"] - rows["random"]["final_accuracy"]
            floor(f"final_accuracy_vs_random {scenario} ({best})", gap, -0.01, True)
            jain = rows[best]["jain"] - rows["random"]["jain"]
            floor(f"jain_vs_random {scenario} ({best})", jain, -0.1, True)
            if "greedy" in rows:
                floor(
                    f"speedup_vs_greedy {scenario} ({best})",
                    rows[best].get("speedup_vs_greedy"),
                    1.2,
                    True,
                )
    cpu = [e["sched_cpu_ms_mean"] for rows in table.values() for e in rows.values()]
    floor("scheduler_cpu_ms_per_round (worst selector)", max(cpu) if cpu else None, 50.0, False)
    return out


def plot(table: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    for scenario, rows in table.items():
        names = [s for s in rows if rows[s]["speedup_vs_random"] is not None]
        meds = [rows[s]["speedup_vs_random"] for s in names]
        lo = [m - rows[s]["speedup_vs_random_ci95"][0] for s, m in zip(names, meds, strict=True)]
        hi = [rows[s]["speedup_vs_random_ci95"][1] - m for s, m in zip(names, meds, strict=True)]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar(names, meds, yerr=[lo, hi], capsize=4, color="#4477aa")
        ax.axhline(1.0, color="grey", lw=1, ls="--")
        ax.set_ylabel("speed-up to target vs random")
        ax.set_title(f"scenario: {scenario} (median, 95% bootstrap CI)")
        fig.tight_layout()
        fig.savefig(out / f"scheduling-{scenario}.png", dpi=110)
        plt.close(fig)


@dataclass
class Report:
    mode: str
    plan: Plan
    runs: list[dict[str, Any]] = field(default_factory=list)
    load: list[float] = field(default_factory=lambda: [os.getloadavg()[0]])

    def to_json(self) -> dict[str, Any]:
        table = summarize(self.runs, self.plan)
        return {
            "benchmark": "scheduling",
            "mode": self.mode,
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "load_average_1m": [*self.load, os.getloadavg()[0]],
            },
            "revision": revision(),
            "plan": {
                "scenarios": self.plan.scenarios,
                "selectors": self.plan.selectors,
                "seeds": self.plan.seeds,
                "targets": {job: t.label() for job, t in self.plan.targets.items()},
                "budgets_s": BUDGETS_S,
                "overrides": self.plan.overrides,
            },
            "table": table,
            "runs": self.runs,
            "floors": floors(table, self.plan),
        }


def markdown(report: dict[str, Any]) -> str:
    """The tables of docs/scheduling.md, one per scenario."""
    out = []
    targets = report["plan"]["targets"]
    for scenario, rows in report["table"].items():
        jobs = sorted(next(iter(rows.values()))["time_to_target_s"])
        head = [
            "selector",
            "speed-up vs random [95% CI]",
            "vs greedy",
            *(f"{j} s to {targets.get(j, targets['*'])}" for j in jobs),
            "final acc",
            *(f"final {j} {targets[j].split()[0]}" for j in jobs if j in targets),
            "Jain",
            "never used",
            "wasted dev-h",
            "CPU ms/decision",
            "censored",
        ]
        out += [f"**{scenario}**", "", "| " + " | ".join(head) + " |"]
        out.append("|" + "---|" * len(head))
        for name, e in rows.items():
            lo, hi = e["speedup_vs_random_ci95"]
            greedy = e.get("speedup_vs_greedy")
            cells = [
                name,
                f"{e['speedup_vs_random']:.2f} [{lo:.2f}, {hi:.2f}]",
                "" if greedy is None else f"{greedy:.2f}",
                *(f"{e['time_to_target_s'][j]:.0f}" for j in jobs),
                f"{e['final_accuracy']:.3f}",
                *(f"{e['final_target_metric'][j]:.3f}" for j in jobs if j in targets),
                f"{e['jain']:.2f}",
                f"{e['never_used']:.2f}",
                f"{e['wasted_device_hours']:.1f}",
                f"{e['sched_cpu_ms_mean']:.1f}",
                str(e["censored_job_seeds"]),
            ]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    for f in report["floors"]:
        verdict = "ok" if f["ok"] else "**not met**"
        out.append(f"- `{f['name']}`: {f['value']:.3f} (limit {f['limit']}) {verdict}")
    return "\n".join(out)


def summary_line(report: dict[str, Any]) -> str:
    parts = []
    for scenario, rows in report["table"].items():
        ups = ", ".join(
            f"{s} {e['speedup_vs_random']:.2f}x" for s, e in rows.items() if s != "random"
        )
        parts.append(f"{scenario}: {ups}")
    ok = sum(f["ok"] for f in report["floors"])
    return f"scheduling: {'; '.join(parts)}; floors {ok}/{len(report['floors'])} ok"


def _one_thread() -> None:
    """Workers share the cores: one torch thread each beats oversubscribing them."""
    import torch

    torch.set_num_threads(1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="unrelated, 3 selectors, 2 seeds")
    parser.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (full: 10)")
    parser.add_argument("--selectors", default="", help="comma-separated (default: all)")
    parser.add_argument("--scenarios", default="", help="comma-separated (default: both)")
    parser.add_argument("--plots", type=Path, default=None, help="write PNG plots here")
    parser.add_argument(
        "--pretrain-rounds",
        type=int,
        default=PRETRAIN_ROUNDS,
        help=f"rounds of the rl pre-training run per scenario (default {PRETRAIN_ROUNDS})",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a scenario field for every run, e.g. scheduling.beta=1000",
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="runs at a time, one CPU thread each (default 1)"
    )
    parser.add_argument(
        "--resummarize",
        type=Path,
        default=None,
        metavar="JSON",
        help="recompute the table, floors and plots from an earlier run's output; run nothing",
    )
    parser.add_argument(
        "--markdown", action="store_true", help="also write the tables as markdown to stderr"
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    plan = QUICK if args.quick else FULL
    if args.seeds:
        plan = dataclasses.replace(plan, seeds=tuple(range(args.seeds)))
    if args.selectors:
        plan = dataclasses.replace(plan, selectors=tuple(args.selectors.split(",")))
    if args.scenarios:
        plan = dataclasses.replace(plan, scenarios=tuple(args.scenarios.split(",")))
    if args.set:
        plan = dataclasses.replace(plan, overrides=(*plan.overrides, *args.set))
    report = Report("quick" if args.quick else "full", plan)
    if args.resummarize is not None:
        earlier = json.loads(args.resummarize.read_text())
        report.mode, report.runs = earlier["mode"], earlier["runs"]
        return emit(report, args.plots, args.markdown)
    todo = [
        (sc, sel, seed) for sc in plan.scenarios for seed in plan.seeds for sel in plan.selectors
    ]
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc="scheduling runs", file=sys.stderr)
    workdir = Path(tempfile.mkdtemp(prefix="flotilla-bench-sched-"))
    try:
        policies = {}
        if "rl-pretrained" in plan.selectors:
            for scenario in plan.scenarios:
                policies[scenario] = pretrain(scenario, plan, workdir, args.pretrain_rounds)
        with ProcessPoolExecutor(args.workers, initializer=_one_thread) as pool:
            running = [
                pool.submit(run_one, sc, sel, seed, plan, workdir, policies)
                for sc, sel, seed in todo
            ]
            for future in running:
                report.runs.append(future.result())
                if bar is not None:
                    bar.update(1)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if bar is not None:
            bar.close()
    return emit(report, args.plots, args.markdown)


def emit(report: Report, plots: Path | None, tables: bool = False) -> int:
    data = report.to_json()
    if plots is not None:
        plot(data["table"], plots)
    print(json.dumps(data, indent=2))
    if tables:
        print(markdown(data), file=sys.stderr)
    print(summary_line(data), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
