#!/usr/bin/env python
"""A foreign peer in a verified volunteer run: does it cost flotilla's volunteers anything?

Issue 21's setup, as a user met it: a peer written only with ``hivemind.DHT`` and
``hivemind.Optimizer`` (``run_id`` = the run's name, no look at the run record) trains
beside flotilla volunteers of a default (verified) ``flotilla volunteer coordinate`` run of
the char LM. Before flotilla's peers moved to their own swarm, such a peer stalled the run.

Two phases on the same machine, alternating: a coordinator and two ``flotilla volunteer``
processes train for a fixed wall time, in the control phase alone, in the measured phase
beside the plain peer, started first under this run's name as the issue's user wrote it.
Each volunteer's report (printed on Ctrl-C, before it leaves) says how many epochs it
averaged with peers; the figure is their sum. The foreign peer's own hivemind log says
whether it ever averaged (it trains alone by construction), and the coordinator's log
whether it named ``--plain-averaging``. The plain peer stands for a peer on another machine:
paced (a step every 0.1 s) and at the lowest CPU priority (nice 19). Without that it
measures how the cores are shared: hivemind's optimizer training alone in a run keeps
about one core busy (0.97 measured here).

Floor (the issue's): volunteers' averaged epochs with the foreign peer >= 0.8x without it,
summed over the repetitions. Stdout carries one JSON object; a summary goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
FLOOR = 0.8
RUN_OPTS = ["--target-batch-size", "96", "--batch-size", "16", "--averaging-timeout", "15"]
FOREIGN = """
import os, sys, time, hivemind, torch
os.nice(19)  # idle cycles only: it stands for a peer on another machine
from flotilla.tasks.charlm import CharLMTask, windows
run, maddr, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
dht = hivemind.DHT(initial_peers=[maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
task = CharLMTask()
model = task.build_model(0)
inputs, targets = windows(task.tokens(), task.context)
opt = hivemind.Optimizer(
    dht=dht, run_id=run, params=model.parameters(), target_batch_size=96,
    batch_size_per_step=16, optimizer=lambda p: torch.optim.Adam(p, lr=0.005), verbose=True,
)
print("training", flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:
    idx = torch.randint(len(targets), (16,))
    loss = torch.nn.functional.cross_entropy(
        model(inputs[idx]).flatten(0, 1), targets[idx].flatten()
    )
    loss.backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.1)  # paced, as a peer elsewhere; hivemind alone in a run is busy anyway
opt.shutdown()
dht.shutdown()
"""


def _spawn(argv: list[str], log: Path, **kw: Any) -> subprocess.Popen[str]:
    # One thread each: five processes share these cores (as the suite runs them).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, *argv], text=True, cwd=ROOT, start_new_session=True, env=env,
        stderr=open(log, "w"), **kw,
    )  # fmt: skip


def _kill(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def phase(workdir: Path, tag: str, seconds: float, foreign: bool) -> dict[str, Any]:
    """One run: coordinator, the plain peer (when ``foreign``), then two volunteers for
    ``seconds``; their averaged epochs from their reports."""
    run = f"foreign-{tag}"
    coord = _spawn(
        ["-m", "flotilla", "volunteer", "coordinate", "--run", run, "--task", TASK,
         "--state-dir", str(workdir / run), *RUN_OPTS],
        workdir / f"{run}-coordinator.err", stdout=subprocess.PIPE,
    )  # fmt: skip
    procs = [coord]
    try:
        assert coord.stdout is not None
        maddr = coord.stdout.readline().strip()
        if foreign:
            peer = _spawn(
                ["-c", FOREIGN, run, maddr, str(seconds + 60)],
                workdir / f"{run}-foreign.err", stdout=subprocess.PIPE,
            )  # fmt: skip
            procs.append(peer)
            assert peer.stdout is not None and peer.stdout.readline().strip() == "training"
        join = ["-m", "flotilla", "volunteer", "--run", run, "--task", TASK]
        volunteers = [
            _spawn(
                [*join, "--initial-peers", maddr],
                workdir / f"{run}-v{i}.err",
                stdout=subprocess.PIPE,
            )
            for i in range(2)
        ]
        procs += volunteers
        time.sleep(seconds)
        reports = []
        for proc in volunteers:
            os.killpg(proc.pid, signal.SIGINT)
        for proc in volunteers:
            out, _ = proc.communicate(timeout=60)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            reports.append(json.loads(lines[-1]) if lines else None)
    finally:
        _kill(procs)
    foreign_log = (workdir / f"{run}-foreign.err").read_text() if foreign else ""
    coord_log = (workdir / f"{run}-coordinator.err").read_text()
    return {
        "foreign_peer": foreign,
        "seconds": seconds,
        "averaged_epochs": [r["averaged_epochs"] if r else 0 for r in reports],
        "epochs": [r["last_epoch"] - r["first_epoch"] if r else 0 for r in reports],
        "foreign_averaged": len(re.findall(r"Averaged \w+ with [2-9]", foreign_log)),
        "coordinator_named_option": "--plain-averaging" in coord_log,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one pair of 45 s runs")
    args = parser.parse_args(argv)
    pairs, seconds = (1, 45.0) if args.quick else (3, 90.0)
    phases = []
    with tempfile.TemporaryDirectory(prefix="flotilla-bench-foreign-") as tmp:
        for i in range(pairs):
            for foreign in (False, True):
                phases.append(phase(Path(tmp), f"{i}-{int(foreign)}", seconds, foreign))
                print(f"p2p_foreign_peer: {phases[-1]}", file=sys.stderr)
    alone = sum(sum(p["averaged_epochs"]) for p in phases if not p["foreign_peer"])
    beside = sum(sum(p["averaged_epochs"]) for p in phases if p["foreign_peer"])
    ratio = beside / alone if alone else None
    named = all(p["coordinator_named_option"] == p["foreign_peer"] for p in phases)
    floors = [
        {
            "name": "averaged_epochs_with_foreign_peer_over_without",
            "value": ratio,
            "limit": FLOOR,
            "ok": ratio is not None and ratio >= FLOOR,
        },
        {
            # It warns of the plain peer in its run, and says nothing of the sort when alone.
            "name": "coordinator_names_plain_averaging_exactly_when_foreign",
            "value": named,
            "limit": True,
            "ok": named,
        },
    ]
    report = {
        "benchmark": "p2p_foreign_peer",
        "mode": "quick" if args.quick else "full",
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "revision": revision(),
        "phases": phases,
        "averaged_epochs": {"without": alone, "with": beside},
        "floors": floors,
    }
    print(json.dumps(report, indent=2))
    ok = sum(f["ok"] for f in floors)
    print(
        f"p2p_foreign_peer: averaged epochs {beside} with / {alone} without"
        f" ({ratio if ratio is None else round(ratio, 2)}x); floors {ok}/{len(floors)} ok",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
