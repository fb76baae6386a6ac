#!/usr/bin/env python
"""Scheduler CPU per decision with 1,000 devices and 8 jobs deciding at once (issue 18).

The study (``benchmarks/scheduling.py``) measures the CPU of the decisions its scenarios
make: at most three jobs on 1,000 devices, or eight on 300. This probe takes the floor's
own setting: a pool of 1,000 devices (speeds, uplinks and sample counts spread like the
study's phones and laptops), eight jobs of one selector asking for 52 devices each at the
same moment, decided by the joint arbiter (one min-cost assignment of the contested
devices, then each job's selector), for several rounds, each round's outcome recorded so
the time models, learners and fairness state fill as in a run. A decision's CPU is the
arbiter's ``Grant.select_cpu_s``: the job's selector plus its share of the assignment.

Prints one JSON object: per selector the median and worst CPU ms per decision, and the
floor (worst selector's median under 50 ms).

    python benchmarks/scheduling_cpu.py --quick    # 4 rounds
    python benchmarks/scheduling_cpu.py            # 10 rounds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

import numpy as np
from provenance import revision  # benchmarks/ is the script's sys.path[0]

from flotilla.core.device import DeviceProfile
from flotilla.core.spec import SchedulingSection
from flotilla.scheduling import (
    SELECTOR_NAMES,
    Arbiter,
    DevicePool,
    DeviceRequest,
    Leases,
    RoundOutcome,
    make_selector,
)

DEVICES = 1000
JOBS = 8
WANT = 52
TASK = "flotilla.tasks.digits:DigitsTask"
FLOOR_MS = 50.0
DEADLINE_S = 300.0


def fleet(rng: np.random.Generator) -> DevicePool:
    """1,000 devices: 70 % phones (slow, 2 Mbps up), 30 % laptops; shards of 10-500."""
    pool = DevicePool(time.monotonic)
    for i in range(DEVICES):
        phone = rng.random() < 0.7
        speed = float(rng.lognormal(np.log(0.3 if phone else 1.0), 0.8 if phone else 0.5))
        upload = float(rng.lognormal(np.log(2e6 if phone else 20e6) / 8, 0.8))
        samples = int(np.exp(rng.uniform(np.log(10), np.log(500))))
        pool.seen(
            DeviceProfile(
                f"d{i:04d}",
                tasks=(TASK,),
                gflops=speed * 10,
                upload_bytes_per_s=upload,
                samples={TASK: samples},
            )
        )
    return pool


async def decisions(selector: str, rounds: int, seed: int) -> list[float]:
    """CPU seconds of every decision of ``rounds`` rounds of 8 jobs deciding together."""
    rng = np.random.default_rng(seed)
    pool = fleet(rng)
    arbiter = Arbiter(pool, time.monotonic, grace_s=0.0, poll_s=0.01)
    leases = Leases(pool)
    section = SchedulingSection(selector=selector)
    jobs = {
        f"job{j}": make_selector(section, pool, random.Random(j), DEADLINE_S, rounds, TASK)
        for j in range(JOBS)
    }
    cpu: list[float] = []
    for round_no in range(1, rounds + 1):
        grants = await asyncio.gather(
            *(arbiter.acquire(DeviceRequest(job, TASK, WANT, 20, sel)) for job, sel in jobs.items())
        )
        for grant in grants:
            cpu.append(grant.select_cpu_s)
            lease = leases.dispatch(grant, list)
            assert lease is not None
            durations, compute, losses, samples = {}, {}, {}, {}
            for device_id in lease.devices:
                profile = pool.profile(device_id)
                assert profile is not None
                n = profile.samples[TASK]
                compute[device_id] = n * 0.05 / max(profile.gflops / 10, 1e-3)
                durations[device_id] = compute[device_id] + 4e5 / profile.upload_bytes_per_s
                losses[device_id] = float(rng.uniform(0.5, 2.0)) / round_no
                samples[device_id] = n
            outcome = RoundOutcome(
                grant.job_id, round_no, durations, (), tuple(lease.devices), compute, losses,
                samples,
            )  # fmt: skip
            pool.record(outcome)
            jobs[grant.job_id].observe(outcome)
            lease.free(lease.devices)
    await arbiter.close()
    return cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 rounds instead of 10")
    parser.add_argument("--selectors", default=",".join(SELECTOR_NAMES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rounds = 4 if args.quick else 10
    results = {}
    for name in args.selectors.split(","):
        ms = [s * 1000 for s in asyncio.run(decisions(name, rounds, args.seed))]
        results[name] = {
            "median_ms": round(statistics.median(ms), 2),
            "worst_ms": round(max(ms), 2),
            "decisions": len(ms),
        }
        print(f"{name}: median {results[name]['median_ms']} ms", file=sys.stderr)
    worst = max(r["median_ms"] for r in results.values())
    floors = [
        {
            "name": f"scheduler CPU ms per decision, {DEVICES} devices, {JOBS} jobs (worst "
            "selector's median)",
            "value": worst,
            "limit": FLOOR_MS,
            "ok": worst < FLOOR_MS,
        }
    ]
    out = {"revision": revision(), "devices": DEVICES, "jobs": JOBS, "want": WANT, "rounds": rounds}
    print(json.dumps({**out, "selectors": results, "floors": floors}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
