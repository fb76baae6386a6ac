"""``flotilla bench load``: many protocol-true devices against a real server (docs/load.md).

It starts its own server (SQLite in a temporary state directory, or ``--db``), runs the
devices in worker processes for ``--duration`` seconds, and prints the results: call
latencies, accepted updates per second, the books (every accepted update committed once)
and the server's memory, file descriptors and tasks over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any


def add_bench_parser(commands: Any) -> None:
    bench = commands.add_parser("bench", help="load-test a server")
    sub = bench.add_subparsers(title="bench commands", metavar="ACTION")
    load = sub.add_parser(
        "load",
        help="run N devices against a fresh server for S seconds",
        description="Start a server, run N protocol-true devices (enrol, poll, model fetch, "
        "signed update upload) as asyncio tasks across a few processes, and report latencies, "
        "throughput and whether every accepted update was committed exactly once.",
    )
    load.add_argument("--devices", type=int, required=True, metavar="N")
    load.add_argument("--duration", type=float, required=True, metavar="S", help="seconds")
    load.add_argument("--edge", choices=("grpc", "http"), default="grpc")
    load.add_argument("--workers", type=int, default=2, help="device processes (default 2)")
    load.add_argument("--jobs", type=int, default=2, help="jobs running at once (default 2)")
    load.add_argument(
        "--clients-per-round", type=int, default=50, metavar="K", help="per job (default 50)"
    )
    load.add_argument(
        "--poll-every", type=float, default=1.0, metavar="S",
        help="an idle device's seconds between polls (the server answers at once)",
    )  # fmt: skip
    load.add_argument(
        "--poll-hold", type=float, default=0.0, metavar="S",
        help="the server's poll hold (default 0: polls answered at once; above 0, long polls "
        "and --poll-every is ignored)",
    )  # fmt: skip
    load.add_argument(
        "--servers", type=int, default=1, metavar="N",
        help="server processes of one deployment (same database and state directory; the "
        "devices get every address; grpc edge only)",
    )  # fmt: skip
    load.add_argument("--db", default=None, help="database URL (default: SQLite, temporary)")
    load.add_argument("--workdir", type=Path, default=None, help="keep the state and logs here")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--json", action="store_true", help="print the results as one JSON object")
    load.set_defaults(handler=run_load_command)


def run_load_command(args: argparse.Namespace) -> int:
    from flotilla.loadgen.run import LoadPlan, run_load

    plan = LoadPlan(
        devices=args.devices,
        duration_s=args.duration,
        edge=args.edge,
        workers=args.workers,
        jobs=args.jobs,
        clients_per_round=args.clients_per_round,
        poll_every_s=args.poll_every,
        poll_hold_s=args.poll_hold,
        db_url=args.db,
        seed=args.seed,
        servers=args.servers,
    )

    def progress(line: str) -> None:
        print(f"bench: {line}", file=sys.stderr, flush=True)

    result = asyncio.run(run_load(plan, args.workdir, progress))
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    poll = result["latency_ms"]["poll"]
    print(
        f"{result['devices']} devices over {result['edge']} for {result['duration_s']:.0f}s: "
        f"poll p50 {poll['p50']} ms, p99 {poll['p99']} ms; "
        f"{result['accepted_per_s']} updates/s accepted; {result['rounds_committed']} rounds; "
        f"lost {result['lost_updates']}, duplicated {result['duplicated_updates']}"
    )
    return 0
