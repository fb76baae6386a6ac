"""A long-lived peer of the partial-average tests; stdin drives it, one trial per line.

For each line ``TRIAL [COMPRESSION]`` it all-reduces a tensor seeded by (rank, trial)
through a fresh SafeAverager (prefix ``trialTRIAL``) and prints one JSON line: the outcome,
and how far its final tensor is from the exact weighted average of the contributors its
round names (or whether it is bit-for-bit its starting tensor). Prints ``ready`` when it
can take a trial.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def initial(rank: int, trial: int, size: int) -> torch.Tensor:
    seed = 1000 * trial + rank
    return torch.randn(size, generator=torch.Generator().manual_seed(seed))


def weight_of(rank: int) -> float:
    return float(rank + 1)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--group-size", type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--host-maddrs", nargs="+", default=None)
    parser.add_argument("--chunk-timeout", type=float, default=2.0)
    args = parser.parse_args()

    from flotilla.p2p import hivemind_compression, start_dht
    from flotilla.p2p.averaging import SafeAverager

    dht = start_dht(args.initial_peers, args.host_maddrs)
    print("ready", flush=True)
    for line in sys.stdin:
        trial_text, _, compression = line.partition(" ")
        trial = int(trial_text)
        start = initial(args.rank, trial, args.size)
        averager = SafeAverager(
            [start.clone()],
            dht,
            prefix=f"trial{trial}",
            target_group_size=args.group_size,
            min_group_size=2,
            min_matchmaking_time=3.0,
            request_timeout=1.0,
            allreduce_timeout=args.timeout,
            sender_timeout=args.chunk_timeout,
            reducer_timeout=2 * args.chunk_timeout,
            next_chunk_timeout=args.chunk_timeout,
            compression=hivemind_compression(compression.strip() or "none"),
            start=True,
        )
        print("armed", flush=True)
        began = time.monotonic()
        result: dict[str, object] = {"rank": args.rank, "trial": trial}
        try:
            got = averager.step(gather=args.rank, weight=weight_of(args.rank), timeout=args.timeout)
            contributors = sorted(int(r) for r in got.gathered.values())
            result.update(
                outcome="committed",
                contributors=contributors,
                reverted=[reason for _, reason in got.reverted],
                allreduce_seconds=got.seconds,
            )
        except Exception as exc:  # the step gave up: the tensor must be the pre-round one
            result.update(outcome="failed", error=f"{type(exc).__name__}: {exc}"[:300])
        result["seconds"] = time.monotonic() - began
        with averager.get_tensors() as (final,):
            final = final.clone()
        averager.shutdown()
        if result["outcome"] == "committed":
            total = sum(weight_of(c) for c in contributors)
            expected = sum(
                weight_of(c) / total * initial(c, trial, args.size).double() for c in contributors
            )
            result["max_error"] = float((final.double() - expected).abs().max())
        result["unchanged"] = bool(torch.equal(final, start))
        print(json.dumps(result), flush=True)
    dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
