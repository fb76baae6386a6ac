#!/usr/bin/env python
"""Peer-to-peer benchmark: what flotilla's p2p layer costs over raw hivemind, and how fast a
volunteer run trains.

(a) All-reduce of float32 tensors (10M; ``--quick``: 1M) across 2, 4 and 8 local peers
(separate processes, 127.0.0.1), through raw ``hivemind.averaging.DecentralizedAverager``
and through flotilla's ``SafeAverager`` (whole-or-nothing rounds: the all-reduce with its
outputs held back, then a verdict round), with compression none / fp16 / int8 (both sides
use the same compression; int8 is flotilla's, since hivemind's own 8-bit decoders fail under
NumPy 2). Raw and flotilla rounds alternate in the same processes, so they see the same
machine; each is timed over the aggregation phase (matchmaking excluded) as the group's
wall-clock span, from the first member starting it to the last one done, and the median over
rounds is reported with the ratio flotilla / raw.

(b) Global samples/s of a char-LM volunteer run (``flotilla volunteer coordinate`` plus 1,
2 and 4 ``flotilla volunteer`` processes), read from the run's status in the DHT.

Floor (the issue's): flotilla adds at most 10 % over raw hivemind (ratio <= 1.10), for each
peer count without compression. Stdout carries one JSON object; a summary goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from provenance import revision  # benchmarks/ is the script's sys.path[0]

ROOT = Path(__file__).resolve().parents[1]
PEER = Path(__file__).resolve().parent / "p2p_peer.py"
TASK = "flotilla.tasks.charlm:CharLMTask"
OVERHEAD_LIMIT = 1.10
#: A peer answers each step within its own 180 s step timeout plus its averager's shutdown.
ROUND_TIMEOUT_S = 240.0
READY_TIMEOUT_S = 120.0
LOG_DIR = Path(tempfile.gettempdir()) / "flotilla-bench-p2p-logs"


@dataclass(frozen=True)
class Plan:
    size: int
    peers: tuple[int, ...]
    compressions: tuple[str, ...]
    rounds: int
    volunteers: tuple[int, ...]
    measure_s: float


FULL = Plan(10_000_000, (2, 4, 8), ("none", "fp16", "int8"), 3, (1, 2, 4), 60.0)
QUICK = Plan(1_000_000, (2, 4), ("none", "int8"), 2, (1, 2), 15.0)


def _spawn(args: list[str], **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *args], text=True, start_new_session=True, cwd=ROOT, **kw
    )


def _kill(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The peer's next stdout line, or TimeoutError: a peer never holds the run up."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
        raise TimeoutError(f"peer {proc.pid} said nothing for {timeout_s:.0f} s")
    return proc.stdout.readline().strip()


def allreduce(plan: Plan, peers: int, compression: str, maddr: str) -> dict[str, Any]:
    tag = f"b{peers}-{compression}-{os.getpid()}"
    procs = [
        _spawn(
            [
                str(PEER),
                "--initial-peers",
                maddr,
                "--rank",
                str(rank),
                "--size",
                str(plan.size),
                "--group-size",
                str(peers),
                "--compression",
                compression,
                "--tag",
                tag,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # Kept for a post-mortem: a peer that hangs says why here.
            stderr=open(LOG_DIR / f"{tag}-{rank}.err", "w"),  # noqa: SIM115
        )
        for rank in range(peers)
    ]
    times: dict[str, list[float]] = {"raw": [], "flotilla": []}
    errors: list[str] = []
    try:
        for proc in procs:
            assert _line(proc, READY_TIMEOUT_S) == "ready"
        hung = False
        for r in range(plan.rounds):
            if hung:
                break
            # Alternate which goes first, so neither always meets a warmer machine.
            for kind in ("raw", "flotilla") if r % 2 == 0 else ("flotilla", "raw"):
                for proc in procs:
                    assert proc.stdin is not None
                    proc.stdin.write(f"{kind} {r}\n")
                    proc.stdin.flush()
                try:
                    results = [json.loads(_line(proc, ROUND_TIMEOUT_S)) for proc in procs]
                except TimeoutError as exc:  # a hung peer: this configuration is over
                    errors.append(f"round {r} ({kind}): {exc}; peer logs in {LOG_DIR}")
                    hung = True
                    break
                failed = [x["error"] for x in results if "error" in x]
                if failed:
                    errors.extend(failed)
                    continue
                # The group's span: from its first member starting to its last finishing.
                # (Per member durations would favour raw hivemind, whose members finish
                # at different times, over flotilla's, which finish together.)
                times[kind].append(
                    max(x["ended"] for x in results) - min(x["began"] for x in results)
                )
    finally:
        _kill(procs)
    raw = statistics.median(times["raw"]) if times["raw"] else None
    ours = statistics.median(times["flotilla"]) if times["flotilla"] else None
    return {
        "peers": peers,
        "compression": compression,
        "floats": plan.size,
        "raw_s": raw,
        "flotilla_s": ours,
        "ratio": ours / raw if raw and ours else None,
        "rounds": {k: v for k, v in times.items()},
        "errors": errors,
    }


def volunteer_run(plan: Plan, volunteers: int, workdir: Path) -> dict[str, Any]:
    from flotilla.p2p import read_status, start_dht

    run = f"bench{volunteers}"
    log = open(workdir / f"{run}.err", "w")  # noqa: SIM115 (closed below)
    coord = _spawn(
        ["-m", "flotilla", "volunteer", "coordinate", "--run", run, "--task", TASK,
         "--state-dir", str(workdir / run), "--target-batch-size", "256",
         "--matchmaking-time", "2", "--averaging-timeout", "20"],
        stdout=subprocess.PIPE, stderr=log,
    )  # fmt: skip
    procs = [coord]
    rates: list[float] = []
    epochs = (0, 0)
    try:
        assert coord.stdout is not None
        maddr = coord.stdout.readline().strip()
        procs += [
            _spawn(
                [
                    "-m",
                    "flotilla",
                    "volunteer",
                    "--run",
                    run,
                    "--task",
                    TASK,
                    "--initial-peers",
                    maddr,
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
            for _ in range(volunteers)
        ]
        dht = start_dht([maddr], client_mode=True)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # warm-up: every volunteer reporting
                status = read_status(dht, run)
                if status is not None and status.peers_online >= volunteers and status.epoch >= 1:
                    break
                time.sleep(1.0)
            first = read_status(dht, run)
            end = time.monotonic() + plan.measure_s
            while time.monotonic() < end:
                status = read_status(dht, run)
                if status is not None and status.samples_per_second > 0:
                    rates.append(status.samples_per_second)
                time.sleep(2.0)
            last = read_status(dht, run)
            if first is not None and last is not None:
                epochs = (first.epoch, last.epoch)
        finally:
            dht.shutdown()
    finally:
        _kill(procs)
        log.close()
    return {
        "volunteers": volunteers,
        "samples_per_second": statistics.median(rates) if rates else None,
        "epochs_during_measurement": epochs[1] - epochs[0],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1M floats, 2-4 peers, short runs")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per configuration")
    parser.add_argument(
        "--compressions", nargs="+", default=None, choices=("none", "fp16", "int8"),
        help="only these compressions (the floor is on none)",
    )  # fmt: skip
    parser.add_argument(
        "--peers", nargs="+", type=int, default=None, help="only these group sizes, e.g. 8"
    )
    parser.add_argument("--no-volunteers", action="store_true", help="skip part (b)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    plan = dataclasses.replace(
        plan,
        rounds=args.rounds or plan.rounds,
        compressions=tuple(args.compressions or plan.compressions),
        peers=tuple(args.peers or plan.peers),
        volunteers=() if args.no_volunteers else plan.volunteers,
    )
    from flotilla.p2p import start_dht

    LOG_DIR.mkdir(exist_ok=True)
    print(f"p2p: peer logs in {LOG_DIR}", file=sys.stderr)
    boot = start_dht()
    maddr = str(boot.get_visible_maddrs()[0])
    rows = []
    try:
        for peers in plan.peers:
            for compression in plan.compressions:
                rows.append(allreduce(plan, peers, compression, maddr))
                print(f"p2p: {peers} peers, {compression}: {rows[-1]['ratio']}", file=sys.stderr)
    finally:
        boot.shutdown()
    runs = []
    with tempfile.TemporaryDirectory(prefix="flotilla-bench-p2p-") as tmp:
        for volunteers in plan.volunteers:
            runs.append(volunteer_run(plan, volunteers, Path(tmp)))
            print(f"p2p: {volunteers} volunteers: {runs[-1]}", file=sys.stderr)
    floors = [
        {
            "name": f"flotilla_over_raw_hivemind ({row['peers']} peers, none)",
            "value": row["ratio"],
            "limit": OVERHEAD_LIMIT,
            "ok": row["ratio"] is not None and row["ratio"] <= OVERHEAD_LIMIT,
        }
        for row in rows
        if row["compression"] == "none"
    ]
    report = {
        "benchmark": "p2p",
        "mode": "quick" if args.quick else "full",
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "revision": revision(),
        "allreduce": rows,
        "volunteer_runs": runs,
        "floors": floors,
    }
    print(json.dumps(report, indent=2))
    ok = sum(f["ok"] for f in floors)
    ratios = ", ".join(
        f"{r['peers']}p/{r['compression']} {r['ratio']:.2f}x" for r in rows if r["ratio"]
    )
    print(f"p2p: flotilla/raw {ratios}; floors {ok}/{len(floors)} ok", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
