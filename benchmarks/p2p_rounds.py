#!/usr/bin/env python
"""Server-less rounds against server rounds: the same digits job, the same agents.

For each wire codec (none, int8) it runs the digits job twice on a real ``flotilla server``
with real ``flotilla client`` processes on 127.0.0.1: once with ``transport = "server"``
(agents upload updates, the server aggregates) and once with ``transport = "p2p"`` (agents
all-reduce among themselves over hivemind, a quorum reports the model hash, one uploads).
It reports, per run: bytes into the server per round (the round records' ``bytes_up``),
median round seconds, final held-out accuracy; and per codec the ratio of the server's
inbound bytes (p2p / server), measured in this run.

Floor (reported, never an exit status): with uncompressed updates a p2p round takes into
the server at most ``1.5 / agents`` of what a server round does (one upload instead of one
per agent), i.e. the server's uplink stops growing with the group.

Stdout carries exactly one JSON object; a summary goes to stderr.

    python benchmarks/p2p_rounds.py --quick    # 5 agents, 4 rounds per run
    python benchmarks/p2p_rounds.py            # 8 agents, 8 rounds per run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from provenance import revision  # benchmarks/ is the script's sys.path[0]

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "digits.toml"
TASK = "flotilla.tasks.digits:DigitsTask"
JOB_TIMEOUT_S = 600.0
FLOOR_FACTOR = 1.5


def cli(*args: str, timeout_s: float = 60.0) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "flotilla", *args], capture_output=True, text=True,
        timeout=timeout_s, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"flotilla {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return proc.stdout


def run_job(work: Path, transport: str, codec: str, agents: int, rounds: int) -> dict[str, Any]:
    """One job on a fresh server and fleet; returns its round records, summarized."""
    state = work / f"{transport}-{codec}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = (work / f"{transport}-{codec}-server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "flotilla", "server", "--host", "127.0.0.1", "--port", "0",
         "--no-http", "--state-dir", str(state), "--liveness", "10"],
        stdout=subprocess.PIPE, stderr=log, text=True, env=env,
    )  # fmt: skip
    fleet: list[subprocess.Popen[bytes]] = []
    try:
        assert server.stdout is not None
        address = ""
        deadline = time.monotonic() + 60
        while not address and time.monotonic() < deadline:
            line = server.stdout.readline()
            if match := re.search(r"listening on (127\.0\.0\.1:\d+)", line):
                address = match.group(1)
            elif not line and server.poll() is not None:
                break
        if not address:
            raise RuntimeError(f"server did not start; see {log.name}")
        base = ["--server", address, "--state-dir", str(state)]
        token = cli("server", "token", "create", "--state-dir", str(state)).split()[-1]
        for i in range(agents):
            out = (work / f"{transport}-{codec}-agent-{i}.log").open("wb")
            cmd = [
                sys.executable, "-m", "flotilla", "client", "--server", address,
                f"--token={token}", "--task", TASK, "--shard", f"{i}/{agents}",
            ]  # fmt: skip
            fleet.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env))
        sets = [
            f"aggregation.transport={transport}", f"compression.uplink={codec}",
            f"job.clients_per_round={agents}", f"job.min_quorum={max(2, agents // 2)}",
            f"job.rounds={rounds}", "job.round_deadline_s=60", "aggregation.matchmaking_s=5",
            f"job.name=bench-{transport}-{codec}",
        ]  # fmt: skip
        args = [item for s in sets for item in ("--set", s)]
        job_id = cli("job", "submit", str(SPEC), *args, *base).split()[-1]
        began = time.monotonic()
        status: dict[str, Any] = {}
        while time.monotonic() - began < JOB_TIMEOUT_S:
            status = json.loads(cli("job", "status", job_id, "--json", *base))
            if status["state"] in ("completed", "failed", "cancelled"):
                break
            time.sleep(1.0)
        if status.get("state") != "completed":
            raise RuntimeError(f"{transport}/{codec} job ended {status.get('state')}")
        detail = json.loads(cli("job", "status", job_id, "--json", "--rounds", *base))
    finally:
        for proc in fleet:
            proc.send_signal(signal.SIGINT)
        for proc in fleet:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    records = detail["rounds"]
    inbound = [r["metrics"].get("bytes_up", 0.0) for r in records]
    return {
        "transport": transport,
        "codec": codec,
        "rounds": len(records),
        "server_bytes_in_per_round": statistics.median(inbound),
        "round_seconds": statistics.median(r["committed_at"] - r["started_at"] for r in records),
        "final_accuracy": detail["metrics"].get("accuracy"),
        "participants_per_round": statistics.median(len(r["participants"]) for r in records),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--agents", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    agents = args.agents or (5 if args.quick else 8)
    rounds = args.rounds or (4 if args.quick else 8)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="flotilla-p2p-rounds-") as tmp:
        for codec in ("none", "int8"):
            for transport in ("server", "p2p"):
                print(f"running {transport} / {codec} ...", file=sys.stderr, flush=True)
                runs.append(run_job(Path(tmp), transport, codec, agents, rounds))
    ratios = {}
    for codec in ("none", "int8"):
        by = {r["transport"]: r for r in runs if r["codec"] == codec}
        ratios[codec] = {
            "server_bytes_in_p2p_over_server": by["p2p"]["server_bytes_in_per_round"]
            / max(by["server"]["server_bytes_in_per_round"], 1.0),
            "round_seconds_p2p_over_server": by["p2p"]["round_seconds"]
            / max(by["server"]["round_seconds"], 1e-9),
        }
    limit = FLOOR_FACTOR / agents
    value = ratios["none"]["server_bytes_in_p2p_over_server"]
    report = {
        "benchmark": "p2p_rounds",
        "revision": revision(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "agents": agents,
        "rounds": rounds,
        "runs": runs,
        "ratios": ratios,
        "floors": [
            {
                "name": "p2p server inbound bytes per round / server transport's (codec none)",
                "value": value,
                "limit": limit,
                "ok": value <= limit,
            }
        ],
    }
    print(json.dumps(report, indent=2))
    for r in runs:
        print(
            f"{r['transport']:>6} {r['codec']:>4}: {r['server_bytes_in_per_round'] / 1e3:8.1f} kB "
            f"in/round, {r['round_seconds']:.2f} s/round, accuracy {r['final_accuracy']:.3f}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
