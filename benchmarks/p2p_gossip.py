#!/usr/bin/env python
"""Group averaging against gossip (sync and async) and no averaging, side by side.

Issue 22's comparison. Volunteers of the char LM train for the same wall time per
configuration, configurations one after another (alternating within each repetition: a
noisy machine hurts them alike), on two links:

- ``loopback``: this machine's, 4 volunteers (2 in ``--quick``);
- ``slow``: ``tests/support/netimpair.py``'s 100 ms each way, 1 % loss, 20 Mbit/s per host
  (a coordinator and 4 volunteers, each in its own network namespace: root only; without
  root, ``--links loopback``); group averaging at
  target batches 96, 512 and 2048 (matchmaking 8 s, as tests/test_p2p_slow_network.py),
  gossip sync and async at 96, and no averaging; then gossip-sync and group at its best
  target batch again with a volunteer killed (kill -9) every 30 s and a fresh one started
  in its place.

Modes: ``group`` (the default verified run: gradients averaged by all-reduce in groups
each epoch), ``gossip-sync``, ``gossip-async`` (push-sum with a neighbour each epoch;
async is delayed averaging, one epoch stale) and ``none`` (a run per volunteer, so each
trains alone). Per configuration: samples/s over the swarm, epochs, epochs mixed or
averaged, **validation loss over wall time** (the coordinator's checkpoints, copied as they
appear and evaluated afterwards on the corpus's held-out text, which no shard holds; a
gossip coordinator's checkpoint is its members' push-sum mean, a group one's the newest
peer state), the **wall time to a fixed validation loss** (``--target-loss``), the final
validation loss, the consensus distance over time (from ``status.json``; for scale, two
models of different seeds are 8.2 apart), and each peer's worst stall (the longest gap
between its epochs, in units of its median epoch).

Floors: on loopback, gossip-sync's samples/s at least 0.95x group's and at least half of
each gossip-sync volunteer's epochs mixed (async mixes as often as a step's trip allows,
reported as mixes per second); on the slow link, gossip's time to the target loss
at most 0.8x group's at group's best target batch, gossip-sync mixing in at least half of
its epochs at a target batch of 96, and kills adding at most two epochs to the survivors'
worst stall (their longest gap between epochs beyond their median epoch) over the same
configuration without kills. A PNG of validation loss against wall time per configuration is written
(``--png``). Stdout carries one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from provenance import revision  # benchmarks/ is the script's sys.path[0]

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the impaired link lives in tests/support

TASK = "flotilla.tasks.charlm:CharLMTask"
COMMON = ["--batch-size", "16", "--learning-rate", "0.005"]
GOSSIP = ["--averaging", "gossip", "--gossip-wait", "5"]
GROUP_LOOPBACK = ["--matchmaking-time", "2", "--averaging-timeout", "15"]
GROUP_SLOW = ["--matchmaking-time", "8", "--averaging-timeout", "60"]
SLOW_LINK = {"delay_ms": 100.0, "loss": 0.01, "rate_mbit": 20.0}
SAMPLES_FLOOR = 0.95
MIXED_FLOOR = 0.5
TIME_TO_LOSS_FLOOR = 0.8
#: What a kill every 30 s may add to the survivors' worst stall (their longest gap between
#: epochs, less their median epoch, in median epochs) over the same run without kills.
STALL_FLOOR = 2.0


@dataclass(frozen=True)
class Config:
    name: str
    mode: str  # group, gossip-sync, gossip-async, none
    target_batch: int
    link: str  # loopback or slow
    kill_every_s: float | None = None

    def runs(self, volunteers: int) -> list[str]:
        """Its runs' names: one per volunteer in ``none`` (each trains alone), else one."""
        if self.mode == "none":
            return [f"{self.name}-{k}" for k in range(volunteers)]
        return [self.name]

    def options(self) -> list[str]:
        # int8 on the slow link, for every mode: what such a link calls for (docs/p2p.md)
        codec = ["--compression", "int8" if self.link == "slow" else "none"]
        tb = ["--target-batch-size", str(self.target_batch), *COMMON, *codec]
        if self.mode == "group":
            return [*tb, *(GROUP_SLOW if self.link == "slow" else GROUP_LOOPBACK)]
        if self.mode == "none":
            return [*tb, "--averaging", "gossip"]
        return [*tb, *GOSSIP, "--gossip-mode", self.mode.removeprefix("gossip-")]


@dataclass
class Outcome:
    reports: list[dict[str, Any]]
    #: Per run: (seconds since the start, checkpoint copy).
    snapshots: list[list[tuple[float, Path]]]
    #: (seconds, consensus distance) from the first run's status.json.
    consensus: list[tuple[float, float]]
    kills: int
    seconds: float


class Hosts:
    """Where processes run: this machine's loopback, or the hosts of an impaired link
    (host 0 the coordinators', 1.. the volunteers')."""

    def __init__(self, net: Any | None) -> None:
        self.net = net

    def maddrs(self, host: int) -> list[str]:
        ip = "127.0.0.1" if self.net is None else self.net.ip(host)
        return ["--host-maddrs", f"/ip4/{ip}/tcp/0"]

    def start(self, host: int, argv: list[str], log: Path) -> subprocess.Popen[str]:
        # One thread each: the processes share these cores.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        full = [sys.executable, "-m", "flotilla", *argv, *self.maddrs(host)]
        kw: dict[str, Any] = dict(
            text=True,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),  # noqa: SIM115
        )
        if self.net is None:
            return subprocess.Popen(full, start_new_session=True, **kw)
        return self.net.popen(host, full, **kw)  # type: ignore[no-any-return]


def _watch(
    state_dirs: list[Path], copies: Path, stop: threading.Event
) -> tuple[list[list[tuple[float, Path]]], list[tuple[float, float]]]:
    """Copy each run's checkpoint as it changes, and read the first run's consensus
    distance, every half second until ``stop``; stamped with ``time.monotonic()``."""
    snapshots: list[list[tuple[float, Path]]] = [[] for _ in state_dirs]
    consensus: list[tuple[float, float]] = []
    seen: list[float] = [0.0] * len(state_dirs)
    last_status = 0.0
    while not stop.wait(0.5):
        for i, state in enumerate(state_dirs):
            path = state / "checkpoint.safetensors"
            with contextlib.suppress(OSError):
                mtime = path.stat().st_mtime
                if mtime != seen[i]:
                    seen[i] = mtime
                    copy = copies / f"{i}-{len(snapshots[i])}.safetensors"
                    shutil.copyfile(path, copy)
                    snapshots[i].append((time.monotonic(), copy))
        if time.monotonic() - last_status >= 2.0:
            last_status = time.monotonic()
            with contextlib.suppress(OSError, ValueError):
                status = json.loads((state_dirs[0] / "status.json").read_text())
                if status.get("consensus_distance") is not None:
                    consensus.append((time.monotonic(), float(status["consensus_distance"])))
    return snapshots, consensus


def _run(workdir: Path, config: Config, volunteers: int, seconds: float, net: Any) -> Outcome:
    """A coordinator and its volunteers (one run each in ``none``), for ``seconds`` of
    training from when every volunteer has joined; their reports and checkpoints."""
    hosts = Hosts(net)
    work = workdir / config.name
    work.mkdir(parents=True)
    runs = config.runs(volunteers)
    per_run = 1 if config.mode == "none" else volunteers
    procs: list[subprocess.Popen[str]] = []
    peers: list[tuple[int, subprocess.Popen[str], Path]] = []  # host, process, log
    stop = threading.Event()
    result: dict[str, Any] = {}
    state_dirs = [work / run for run in runs]
    (work / "copies").mkdir()
    watcher = threading.Thread(
        target=lambda: result.update(
            zip(("snapshots", "consensus"), _watch(state_dirs, work / "copies", stop), strict=True)
        )
    )
    start_at = time.monotonic()
    kills = 0
    try:
        maddrs: list[str] = []
        for run, state in zip(runs, state_dirs, strict=True):
            coord = hosts.start(
                0,
                [
                    "volunteer",
                    "coordinate",
                    "--run",
                    run,
                    "--task",
                    TASK,
                    "--state-dir",
                    str(state),
                    *config.options(),
                ],
                work / f"{run}-coordinator.err",
            )
            procs.append(coord)
            assert coord.stdout is not None
            maddrs.append(coord.stdout.readline().strip())
        watcher.start()

        def volunteer(k: int, name: str) -> None:
            run, maddr = runs[k // per_run], maddrs[k // per_run]
            log = work / f"{name}.err"
            proc = hosts.start(
                1 + k, ["volunteer", "--run", run, "--task", TASK, "--initial-peers", maddr], log
            )
            peers.append((1 + k, proc, log))

        for k in range(volunteers):
            volunteer(k, f"v{k}")
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not all(
            "joined run " in log.read_text() for _, _, log in peers
        ):
            time.sleep(0.5)
        start_at = time.monotonic()
        end = start_at + seconds
        next_kill = start_at + (config.kill_every_s or 1e9)
        while time.monotonic() < end:
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))
            if time.monotonic() >= next_kill:
                victim = kills % volunteers
                _, proc, _ = next(p for p in peers if p[0] == 1 + victim and p[1].poll() is None)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                kills += 1
                volunteer(victim, f"v{victim}-{kills}")
                next_kill += config.kill_every_s or 1e9
        reports = []
        alive = [(h, p, log) for h, p, log in peers if p.poll() is None]
        for _, proc, _ in alive:
            os.killpg(proc.pid, signal.SIGINT)
        for _, proc, _ in alive:
            try:
                out, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate(timeout=30)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if lines:
                reports.append(json.loads(lines[-1]))
        stop.set()
        watcher.join(timeout=30)
        # The training period only: what the peers hold as they leave is not the run's.
        snapshots = [
            [(t - start_at, path) for t, path in run if t <= end]
            for run in result.get("snapshots", [])
        ]
        consensus = [(t - start_at, d) for t, d in result.get("consensus", []) if t <= end]
        return Outcome(reports, snapshots, consensus, kills, seconds)
    finally:
        stop.set()
        for proc in procs + [p for _, p, _ in peers]:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)


class Evaluator:
    """Validation loss of a checkpoint on the corpus's held-out text."""

    def __init__(self) -> None:
        import torch

        from flotilla.tasks.charlm import CharLMTask

        torch.set_num_threads(2)
        self.task = CharLMTask()
        self.heldout = self.task.heldout()
        self._models: dict[int, Any] = {}
        self._records: dict[Path, Any] = {}

    def loss(self, path: Path, state_dir: Path) -> float:
        from flotilla.p2p.record import RunRecord
        from flotilla.p2p.swarm import load_checkpoint

        if state_dir not in self._records:  # one run's record, for all its checkpoints
            saved = (state_dir / "record.json").read_text()
            self._records[state_dir] = RunRecord.from_dict(json.loads(saved))
        record = self._records[state_dir]
        if record.seed not in self._models:
            self._models[record.seed] = self.task.build_model(record.seed)
        model = self._models[record.seed]
        load_checkpoint(path, model, record)
        return float(self.task.evaluate(model, self.heldout)["loss"])


def _curves(
    outcome: Outcome, work: Path, runs: list[str], evaluator: Evaluator
) -> list[list[list[float]]]:
    curves = []
    for run, snaps in zip(runs, outcome.snapshots, strict=False):
        curves.append([[round(t, 2), round(evaluator.loss(p, work / run), 4)] for t, p in snaps])
    return curves


def _time_to(curve: list[list[float]], target: float) -> float | None:
    return next((t for t, loss in curve if t >= 0 and loss <= target), None)


def _final(curve: list[list[float]]) -> float | None:
    return curve[-1][1] if curve else None


def _gaps(report: dict[str, Any]) -> list[float]:
    """Seconds between a peer's epochs (its first two, the joining, left out)."""
    started = sorted((int(e), t) for e, t in report.get("epoch_started", {}).items())[2:]
    return [b[1] - a[1] for a, b in itertools.pairwise(started)]


def _worst_gap(report: dict[str, Any]) -> float:
    return round(max(_gaps(report), default=0.0), 2)


def _stalls(reports: list[dict[str, Any]]) -> list[float]:
    """Each peer's longest gap between epochs, less its median epoch, in median epochs
    (its first two epochs, the joining, left out)."""
    worst = []
    for r in reports:
        gaps = _gaps(r)
        if len(gaps) >= 3:
            usual = statistics.median(gaps)
            worst.append(round((max(gaps) - usual) / usual, 2) if usual > 0 else 0.0)
    return worst


def _summary(
    config: Config, outcome: Outcome, curves: list[list[list[float]]], target: float
) -> dict[str, Any]:
    done = outcome.reports
    epochs = [r["last_epoch"] - r["first_epoch"] for r in done]
    times = [_time_to(c, target) for c in curves]
    finals = [f for f in (_final(c) for c in curves) if f is not None]
    reached = [t for t in times if t is not None]
    return {
        "config": config.name,
        "mode": config.mode,
        "target_batch": config.target_batch,
        "link": config.link,
        "kill_every_s": config.kill_every_s,
        "kills": outcome.kills,
        "seconds": outcome.seconds,
        "reports": len(done),
        "samples_per_s": round(sum(r["samples"] for r in done) / outcome.seconds, 1),
        "epochs": epochs,
        "averaged_epochs": [r["averaged_epochs"] for r in done],
        "mixes_per_s": [round(r["averaged_epochs"] / outcome.seconds, 2) for r in done],
        # none: one run per volunteer; its time is the median run's (a run that never got
        # there counts as not reaching it)
        "time_to_target_s": statistics.median(reached) if len(reached) * 2 > len(times) else None,
        "final_val_loss": round(statistics.mean(finals), 4) if finals else None,
        "val_loss_curves": curves,
        "consensus_distance": [[round(t, 1), round(d, 3)] for t, d in outcome.consensus],
        "worst_stall_epochs": _stalls(done),
        "worst_gap_s": max((_worst_gap(r) for r in done), default=None),
    }


def _plot(results: list[dict[str, Any]], path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = sorted({r["link"] for r in results})
    fig, axes = plt.subplots(1, len(links), figsize=(7 * len(links), 4.5), squeeze=False)
    for ax, link in zip(axes[0], links, strict=True):
        for n, r in enumerate(r for r in results if r["link"] == link):
            color = f"C{n % 10}"  # a configuration's runs (none: one per volunteer) alike
            for i, curve in enumerate(r["val_loss_curves"]):
                if curve:
                    xs, ys = zip(*curve, strict=True)
                    label = r["config"] if i == 0 else None
                    ax.plot(xs, ys, color=color, label=label, alpha=0.9 if i == 0 else 0.35)
        ax.axhline(target, color="grey", linestyle=":", label=f"target {target}")
        ax.set_title(f"char LM, 4 volunteers, {link} link")
        ax.set_xlabel("wall time since all joined (s)")
        ax.set_ylabel("validation loss (nats/char)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _time_to_group_loss(results: list[dict[str, Any]]) -> float | None:
    """On the slow link, each configuration's time to the lowest validation loss a group
    configuration ended at (a target group certainly reaches, so every ratio is a real
    one); the loss, or None without group results."""
    slow = [r for r in results if r["link"] == "slow" and not r["kill_every_s"]]
    finals = [r["final_val_loss"] for r in slow if r["mode"] == "group" and r["final_val_loss"]]
    if not finals:
        return None
    target = min(finals)
    for r in slow:
        times = [_time_to(c, target) for c in r["val_loss_curves"]]
        reached = [t for t in times if t is not None]
        r["time_to_group_best_loss_s"] = (
            statistics.median(reached) if len(reached) * 2 > len(times) else None
        )
    return target


def _best(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The configuration first to the target loss, else the lowest final loss."""
    reached = [r for r in results if r["time_to_target_s"] is not None]
    if reached:
        return min(reached, key=lambda r: r["time_to_target_s"])
    return min(results, key=lambda r: r["final_val_loss"] or 99.0, default=None)


def _floor(name: str, value: float | None, limit: float, ok: bool) -> dict[str, Any]:
    return {"name": name, "value": value, "limit": limit, "ok": ok}


def _floors(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {r["config"]: r for r in results}
    floors = []

    def rate(name: str) -> float | None:
        return by[name]["samples_per_s"] if name in by else None

    group, sync = rate("loopback-group"), rate("loopback-gossip-sync")
    ratio = round(sync / group, 3) if group and sync is not None else None
    floors.append(
        _floor(
            "gossip_sync_samples_per_s_over_group_loopback",
            ratio,
            SAMPLES_FLOOR,
            ratio is not None and ratio >= SAMPLES_FLOOR,
        )
    )
    # sync mixes every epoch the link allows; async as often as a step's trip allows,
    # never waiting (its mixes per second are reported, not floored)
    mixed = [
        a / e if e else 0.0
        for r in results
        if r["link"] == "loopback" and r["mode"] == "gossip-sync"
        for a, e in zip(r["averaged_epochs"], r["epochs"], strict=True)
    ]
    worst = round(min(mixed), 3) if mixed else None
    floors.append(
        _floor(
            "gossip_sync_epochs_mixed_worst_volunteer_loopback",
            worst,
            MIXED_FLOOR,
            worst is not None and worst >= MIXED_FLOOR,
        )
    )
    slow_groups = [
        r for r in results if r["link"] == "slow" and r["mode"] == "group" and not r["kill_every_s"]
    ]
    if slow_groups:
        # A group that never reached the target is counted at its run's length (a lower
        # bound on its time), so the ratio is then an upper bound on the true one.
        group_best = min(r["time_to_target_s"] or r["seconds"] for r in slow_groups)
        gossip = [
            r["time_to_target_s"]
            for r in results
            if r["link"] == "slow"
            and r["mode"].startswith("gossip")
            and not r["kill_every_s"]
            and r["time_to_target_s"] is not None
        ]
        ratio = round(min(gossip) / group_best, 3) if gossip else None
        floors.append(
            _floor(
                "gossip_time_to_val_loss_over_best_group_slow_link",
                ratio,
                TIME_TO_LOSS_FLOOR,
                ratio is not None and ratio <= TIME_TO_LOSS_FLOOR,
            )
        )
        g96 = by.get("slow-gossip-sync-96")
        mixed96 = (
            round(
                min(
                    a / e if e else 0.0
                    for a, e in zip(g96["averaged_epochs"], g96["epochs"], strict=True)
                ),
                3,
            )
            if g96 and g96["epochs"]
            else None
        )
        floors.append(
            _floor(
                "gossip_epochs_mixed_worst_volunteer_slow_link_tb96",
                mixed96,
                MIXED_FLOOR,
                mixed96 is not None and mixed96 >= MIXED_FLOOR,
            )
        )
    for churn in (r for r in results if r["kill_every_s"] and r["mode"].startswith("gossip")):
        calm = by.get(churn["config"].removesuffix("-kills"))
        # What kills add to the worst stall the link and the shared cores already cause.
        added = (
            round(max(churn["worst_stall_epochs"]) - max(calm["worst_stall_epochs"]), 2)
            if calm and churn["worst_stall_epochs"] and calm["worst_stall_epochs"]
            else None
        )
        floors.append(
            _floor("gossip_survivor_stall_added_by_kills_epochs", added, STALL_FLOOR,
                   added is not None and added <= STALL_FLOOR)
        )  # fmt: skip
    return floors


def _configs(links: set[str]) -> tuple[list[Config], list[Config]]:
    """The loopback and the slow link's configurations, for the links asked for."""
    loopback = [
        Config(f"loopback-{mode}", mode, 96, "loopback")
        for mode in ("group", "gossip-sync", "gossip-async", "none")
    ]
    slow = [
        *(Config(f"slow-group-{tb}", "group", tb, "slow") for tb in (96, 512, 2048)),
        Config("slow-gossip-sync-96", "gossip-sync", 96, "slow"),
        Config("slow-gossip-async-96", "gossip-async", 96, "slow"),
        Config("slow-none-96", "none", 96, "slow"),
    ]
    return (
        loopback if "loopback" in links else [],
        slow if "slow" in links else [],
    )


@contextlib.contextmanager
def _slow_link(volunteers: int) -> Iterator[Any]:
    """A host for the coordinators and one per volunteer, on the impaired link."""
    from tests.support.netimpair import impaired_network

    with impaired_network(1 + volunteers, **SLOW_LINK) as net:
        yield net


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="loopback only, 2 volunteers, 12 s per mode"
    )
    parser.add_argument(
        "--links", default="loopback,slow", help="which links to measure (--quick: loopback)"
    )
    parser.add_argument(
        "--seconds", type=float, default=None, help="training time per configuration"
    )
    parser.add_argument(
        "--target-loss",
        type=float,
        default=3.0,
        help="the validation loss (nats/char) to time; 4.56 is a model that learned nothing",
    )
    parser.add_argument("--only", default="", help="configurations whose name has this")
    parser.add_argument("--kill-every", type=float, default=30.0)
    parser.add_argument("--png", type=Path, default=ROOT / "docs" / "img" / "p2p_gossip.png")
    args = parser.parse_args(argv)
    volunteers = 2 if args.quick else 4
    # The slow link's runs are longer: group averaging over it needs the time to get there.
    seconds = {
        "loopback": args.seconds or (12.0 if args.quick else 60.0),
        "slow": args.seconds or 120.0,
    }
    links = {"loopback"} if args.quick else set(args.links.split(","))
    loopback, slow = _configs(links)
    if args.only:
        loopback = [c for c in loopback if args.only in c.name]
        slow = [c for c in slow if args.only in c.name]
    evaluator = Evaluator()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="flotilla-bench-gossip-") as tmp:
        workdir = Path(tmp)

        def measure(config: Config, net: Any) -> dict[str, Any]:
            outcome = _run(workdir, config, volunteers, seconds[config.link], net)
            curves = _curves(outcome, workdir / config.name, config.runs(volunteers), evaluator)
            summary = _summary(config, outcome, curves, args.target_loss)
            brief = {
                k: v
                for k, v in summary.items()
                if k not in ("val_loss_curves", "consensus_distance")
            }
            print(f"p2p_gossip: {json.dumps(brief)}", file=sys.stderr, flush=True)
            return summary

        for config in loopback:
            results.append(measure(config, None))
        if slow:
            with _slow_link(volunteers) as net:
                for config in slow:
                    results.append(measure(config, net))
                # Churn: the best of each kind again, a volunteer killed every so often.
                for kind in ("group", "gossip"):
                    best = _best(
                        [r for r in results if r["link"] == "slow" and r["mode"].startswith(kind)]
                    )
                    if best is not None and (not args.only or args.only in "kills"):
                        config = Config(
                            f"{best['config']}-kills",
                            best["mode"],
                            best["target_batch"],
                            "slow",
                            args.kill_every,
                        )
                        results.append(measure(config, net))
    group_best_loss = _time_to_group_loss(results)
    floors = _floors(results)
    if not args.quick:
        args.png.parent.mkdir(parents=True, exist_ok=True)
        _plot(results, args.png, args.target_loss)
    report = {
        "benchmark": "p2p_gossip",
        "mode": "quick" if args.quick else "full",
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "revision": revision(),
        "setup": {
            "volunteers": volunteers,
            "seconds": seconds,
            "target_val_loss": args.target_loss,
            "group_best_final_val_loss": group_best_loss,
            "slow_link": SLOW_LINK if slow else None,
            "options": COMMON,
            "png": None if args.quick else str(args.png),
        },
        "results": results,
        "floors": floors,
    }
    print(json.dumps(report))
    ok = sum(f["ok"] for f in floors)
    print(f"p2p_gossip: floors {ok}/{len(floors)} ok", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
