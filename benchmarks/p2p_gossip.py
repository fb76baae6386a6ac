#!/usr/bin/env python
"""Group averaging against gossip (sync and async) and no averaging, side by side.

Issue 22's comparison, first part: volunteers of the char LM on this machine's loopback,
one run per mode, each for the same wall time, modes alternating within each repetition (a
noisy machine hurts them alike). Modes: ``group`` (the default verified run: gradients
averaged by all-reduce in groups each epoch, matchmaking 2 s), ``gossip-sync``, ``gossip-
async`` (push-sum with a neighbour each epoch; async is delayed averaging) and ``none``
(volunteers that never average: a coordinator of a gossip run with one volunteer per run,
so each trains alone). Per mode: samples/s over the swarm, epochs, epochs mixed or
averaged, the training loss reached (the mean over volunteers of their last three epochs'
losses on their own shards: training loss, not a validation loss, so a peer that never
averages looks best by overfitting its shard) after the fixed time, and for gossip the
consensus distance ``status`` reports at the end (from the peers' sketches; for scale, the
char LM's initial parameters have norm 18.8, and two models of different seeds are 8.2
apart).

Floors: gossip-sync's samples/s at least 0.95x group's (no barrier, so no slower); and
gossip mixes: at least half of each gossip volunteer's epochs mixed with a neighbour. The
slow-link, kill -9, time-to-loss and consensus-over-time parts of the issue are not here
yet. Stdout carries one JSON object; a summary goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from provenance import revision  # benchmarks/ is the script's sys.path[0]

ROOT = Path(__file__).resolve().parents[1]
TASK = "flotilla.tasks.charlm:CharLMTask"
COMMON = ["--target-batch-size", "96", "--batch-size", "16", "--learning-rate", "0.005"]
MODES: dict[str, list[str]] = {
    # hivemind's gradient averaging, as the volunteer tests run it (matchmaking 2 s).
    "group": ["--matchmaking-time", "2", "--averaging-timeout", "15"],
    "gossip-sync": ["--averaging", "gossip", "--gossip-mode", "sync", "--gossip-wait", "5"],
    "gossip-async": ["--averaging", "gossip", "--gossip-mode", "async", "--gossip-wait", "5"],
    "none": ["--averaging", "gossip"],  # one volunteer per run: nobody to mix with
}
SAMPLES_FLOOR = 0.95
MIXED_FLOOR = 0.5


def _spawn(argv: list[str], log: Path, **kw: Any) -> subprocess.Popen[str]:
    # One thread each: the processes share these cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "flotilla", *argv], text=True, cwd=ROOT, env=env,
        start_new_session=True, stderr=open(log, "w"), **kw,
    )  # fmt: skip


def _consensus(run: str, maddr: str) -> float | None:
    """The run's consensus distance as ``status --json`` says it (gossip runs only)."""
    out = subprocess.run(
        [sys.executable, "-m", "flotilla", "volunteer", "status", "--run", run,
         "--initial-peers", maddr, "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    if out.returncode != 0:
        return None
    value = json.loads(out.stdout).get("consensus_distance")
    return float(value) if value is not None else None


def _run(
    workdir: Path,
    runs: list[str],
    options: list[str],
    per_run: int,
    seconds: float,
    consensus: bool,
) -> tuple[list, list[float]]:
    """A coordinator and ``per_run`` volunteers for each of ``runs``, all at once, for
    ``seconds`` of training from when every volunteer has joined; their reports."""
    procs: list[subprocess.Popen[str]] = []
    try:
        peers, logs, maddrs = [], [], []
        for run in runs:
            coord = _spawn(
                ["volunteer", "coordinate", "--run", run, "--task", TASK,
                 "--state-dir", str(workdir / run), *COMMON, *options],
                workdir / f"{run}-coordinator.err", stdout=subprocess.PIPE,
            )  # fmt: skip
            procs.append(coord)
            assert coord.stdout is not None
            maddr = coord.stdout.readline().strip()
            maddrs.append((run, maddr))
            for i in range(per_run):
                logs.append(workdir / f"{run}-v{i}.err")
                peers.append(
                    _spawn(
                        ["volunteer", "--run", run, "--task", TASK, "--initial-peers", maddr],
                        logs[-1],
                        stdout=subprocess.PIPE,
                    )
                )
        procs += peers
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(
            "joined run " in log.read_text() for log in logs
        ):
            time.sleep(0.5)
        time.sleep(seconds)
        distances = [_consensus(run, maddr) for run, maddr in maddrs] if consensus else []
        for proc in peers:
            os.killpg(proc.pid, signal.SIGINT)
        reports = []
        for proc in peers:
            out, _ = proc.communicate(timeout=60)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            reports.append(json.loads(lines[-1]) if lines else None)
        return reports, [d for d in distances if d is not None]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _summary(reports: list, seconds: float) -> dict[str, Any]:
    done = [r for r in reports if r]
    epochs = [r["last_epoch"] - r["first_epoch"] for r in done]
    finals = []
    for r in done:
        losses = [r["epoch_losses"][k] for k in sorted(r["epoch_losses"], key=int)]
        if losses:
            finals.append(sum(losses[-3:]) / len(losses[-3:]))
    return {
        "volunteers": len(reports),
        "reports": len(done),
        "samples_per_s": sum(r["samples"] for r in done) / seconds,
        "epochs": epochs,
        "averaged_epochs": [r["averaged_epochs"] for r in done],
        "final_loss": sum(finals) / len(finals) if finals else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="2 volunteers, 12 s per mode, no consensus"
    )
    args = parser.parse_args(argv)
    volunteers, seconds, repeats = (2, 12.0, 1) if args.quick else (4, 45.0, 2)
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="flotilla-bench-gossip-") as tmp:
        for rep in range(repeats):
            for mode, options in MODES.items():
                if mode == "none":  # a run each: nobody to average with
                    runs, per_run = [f"{mode}-{rep}-{k}" for k in range(volunteers)], 1
                else:
                    runs, per_run = [f"{mode}-{rep}"], volunteers
                gossip = mode.startswith("gossip") and not args.quick
                reports, distances = _run(Path(tmp), runs, options, per_run, seconds, gossip)
                results[mode].append(
                    {**_summary(reports, seconds), "consensus_distance": distances or None}
                )
                print(f"p2p_gossip: {mode} {results[mode][-1]}", file=sys.stderr)

    def mean(mode: str, key: str) -> float | None:
        values = [r[key] for r in results[mode] if r[key] is not None]
        return sum(values) / len(values) if values else None

    group_rate, sync_rate = mean("group", "samples_per_s"), mean("gossip-sync", "samples_per_s")
    rate_ratio = sync_rate / group_rate if group_rate and sync_rate is not None else None
    mixed = [
        a / e if e else 0.0
        for mode in ("gossip-sync", "gossip-async")
        for r in results[mode]
        for a, e in zip(r["averaged_epochs"], r["epochs"], strict=True)
    ]
    worst_mixed = min(mixed) if mixed else None
    floors = [
        {
            "name": "gossip_sync_samples_per_s_over_group_loopback",
            "value": rate_ratio,
            "limit": SAMPLES_FLOOR,
            "ok": rate_ratio is not None and rate_ratio >= SAMPLES_FLOOR,
        },
        {
            "name": "gossip_epochs_mixed_with_a_neighbour_worst_volunteer",
            "value": worst_mixed,
            "limit": MIXED_FLOOR,
            "ok": worst_mixed is not None and worst_mixed >= MIXED_FLOOR,
        },
    ]
    report = {
        "benchmark": "p2p_gossip",
        "mode": "quick" if args.quick else "full",
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "revision": revision(),
        "setup": {
            "volunteers": volunteers,
            "seconds": seconds,
            "repeats": repeats,
            "link": "loopback",
            "options": COMMON,
        },
        "modes": results,
        "summary": {
            mode: {
                "samples_per_s": mean(mode, "samples_per_s"),
                "final_loss": mean(mode, "final_loss"),
            }
            for mode in MODES
        },
        "floors": floors,
    }
    print(json.dumps(report, indent=2))
    ok = sum(f["ok"] for f in floors)
    lines = ", ".join(
        f"{m} {s['samples_per_s']:.0f} samples/s loss {s['final_loss'] or float('nan'):.3f}"
        for m, s in report["summary"].items()
        if s["samples_per_s"] is not None
    )
    print(f"p2p_gossip: {lines}; floors {ok}/{len(floors)} ok", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
