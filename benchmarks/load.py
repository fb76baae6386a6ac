#!/usr/bin/env python
"""Load on one server: concurrent devices against poll latency, CPU and accepted updates/s.

Each row is one ``flotilla.loadgen`` run (what ``flotilla bench load`` runs): a fresh
``flotilla server`` (SQLite, or ``--db``), devices in worker processes on this machine,
each doing what an agent does on the wire (enrol, poll, model fetch, signed update upload
of a 100k-parameter synthetic model), and the books checked after from the server's
committed rounds.

- **Latency rows** (100, 500, 1,000 devices; ``--quick``: 100, 500): the server answers
  polls at once (``--poll-hold 0``) and every idle device polls once a second, so N
  devices make about N polls a second: poll p50/p99, server CPU, commit latency per round.
- **Throughput row**: long polls (the server holds them 5 s, so work reaches a device the
  moment it is dispatched), 4 jobs of 50 devices a round over 250 devices: accepted
  100k-parameter updates per second.

Floors (reported, never an exit status):

- >= 200 accepted 100k-parameter updates per second, devices on the same 2-core machine;
- poll p99 <= 250 ms at the largest device count;
- no accepted update lost or committed twice, in every row;
- with ``--db``: two server processes accept >= 1.5x what one does.

With ``--db postgresql://...``: the throughput row again with two server processes of one
  deployment (same database and state directory; devices given both addresses, half of
  them starting at each; the four jobs split two and two), and the ratio to one.

Stdout carries exactly one JSON object; a one-line summary goes to stderr.

    python benchmarks/load.py --quick     # 100 and 500 devices, 15 s each; about 2 minutes
    python benchmarks/load.py             # 100, 500, 1,000 devices, 60 s each
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import sys
from typing import Any

from provenance import revision  # benchmarks/ is the script's sys.path[0]

from flotilla.loadgen.run import LoadPlan, run_load

UPDATES_PER_S_FLOOR = 200.0
POLL_P99_MS_LIMIT = 250.0
TWO_SERVERS_RATIO = 1.5


def _progress(line: str) -> None:
    print(f"load: {line}", file=sys.stderr, flush=True)


def _row(result: dict[str, Any]) -> dict[str, Any]:
    keep = ("edge", "servers", "devices", "duration_s", "jobs", "clients_per_round", "poll_every_s",
            "poll_hold_s", "database", "enrolled", "accepted_updates", "accepted_per_s",
            "rounds_committed", "retried_rounds", "round_seconds", "lost_updates",
            "duplicated_updates", "uncommitted_at_end", "not_accepted", "errors",
            "stuck_devices", "latency_ms", "server", "deployment")  # fmt: skip
    return {k: result[k] for k in keep}


async def measure(quick: bool, db_url: str | None, edge: str) -> dict[str, Any]:
    counts = (100, 500) if quick else (100, 500, 1000)
    seconds = 15.0 if quick else 60.0
    latency_rows = []
    for n in counts:
        plan = LoadPlan(devices=n, duration_s=seconds, edge=edge, workers=2, jobs=2,
                        clients_per_round=50, db_url=db_url)  # fmt: skip
        latency_rows.append(_row(await run_load(plan, progress=_progress)))
    throughput_plan = LoadPlan(devices=250, duration_s=seconds, edge=edge, workers=2, jobs=4,
                               clients_per_round=50, poll_hold_s=5.0, db_url=db_url)  # fmt: skip
    throughput = _row(await run_load(throughput_plan, progress=_progress))
    measured: dict[str, Any] = {"latency": latency_rows, "throughput": throughput}
    if db_url is not None and edge == "grpc":
        two = dataclasses.replace(throughput_plan, servers=2)
        measured["throughput_two_servers"] = _row(await run_load(two, progress=_progress))
    return measured


def floors(report: dict[str, Any]) -> list[dict[str, Any]]:
    largest = report["latency"][-1]
    two = report.get("throughput_two_servers")
    rows = [*report["latency"], report["throughput"], *([two] if two else [])]
    bad_books = sum(r["lost_updates"] + r["duplicated_updates"] for r in rows)
    p99 = largest["latency_ms"]["poll"]["p99"]
    rate = report["throughput"]["accepted_per_s"]
    out = [
        {"name": "accepted 100k-parameter updates per second (one server, 2 cores)",
         "value": rate, "limit": UPDATES_PER_S_FLOOR, "ok": rate >= UPDATES_PER_S_FLOOR},
        {"name": f"poll p99 ms at {largest['devices']} devices", "value": p99,
         "limit": POLL_P99_MS_LIMIT, "ok": p99 <= POLL_P99_MS_LIMIT},
        {"name": "accepted updates lost or committed twice, all rows", "value": bad_books,
         "limit": 0, "ok": bad_books == 0},
    ]  # fmt: skip
    if two is not None:
        ratio = round(two["accepted_per_s"] / max(rate, 1e-9), 2)
        out.append({"name": "two server processes accept / one (one deployment, PostgreSQL)",
                    "value": ratio, "limit": TWO_SERVERS_RATIO,
                    "ok": ratio >= TWO_SERVERS_RATIO})  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100 and 500 devices, 15 s each")
    parser.add_argument(
        "--db", default=None, help="an empty database's URL (default: SQLite, temporary)"
    )
    parser.add_argument("--edge", choices=("grpc", "http"), default="grpc")
    args = parser.parse_args()
    measured = asyncio.run(measure(args.quick, args.db, args.edge))
    report: dict[str, Any] = {
        "benchmark": "load",
        "mode": "quick" if args.quick else "full",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "revision": revision(),
        **measured,
    }
    report["floors"] = floors(report)
    print(json.dumps(report))
    failed = [f["name"] for f in report["floors"] if not f["ok"]]
    largest = report["latency"][-1]
    print(
        f"load: {largest['devices']} devices poll p99 {largest['latency_ms']['poll']['p99']} ms; "
        f"{report['throughput']['accepted_per_s']} updates/s; floors "
        f"{len(report['floors']) - len(failed)}/{len(report['floors'])} ok"
        + (f" (failed: {'; '.join(failed)})" if failed else ""),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
