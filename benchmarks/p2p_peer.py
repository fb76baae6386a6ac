"""One peer of benchmarks/p2p.py: on each stdin line ``KIND ROUND``, all-reduce a seeded
tensor through raw hivemind (``raw``) or flotilla's SafeAverager (``flotilla``) and print
one JSON line with the all-reduce's seconds (matchmaking excluded). ``ready`` when started."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager


class TimedAverager(DecentralizedAverager):  # type: ignore[misc]
    """Raw hivemind, timed the way SafeAverager times itself (the aggregation phase)."""

    async def _aggregate_with_group(self, group_info: Any, min_vector_size: int, **kw: Any) -> Any:
        began = time.perf_counter()
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kw)
        return {"seconds": time.perf_counter() - began, "size": len(gathered)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--group-size", type=int, required=True)
    parser.add_argument("--compression", required=True)
    parser.add_argument("--tag", required=True)
    args = parser.parse_args()

    from flotilla.p2p import hivemind_compression, start_dht
    from flotilla.p2p.averaging import SafeAverager

    dht = start_dht(args.initial_peers)
    compression = hivemind_compression(args.compression)
    print("ready", flush=True)
    for line in sys.stdin:
        kind, round_ = line.split()
        tensor = torch.randn(args.size, generator=torch.Generator().manual_seed(args.rank))
        cls = SafeAverager if kind == "flotilla" else TimedAverager
        averager = cls(
            [tensor],
            dht,
            prefix=f"{args.tag}-{kind}-{round_}",
            target_group_size=args.group_size,
            min_group_size=args.group_size,
            min_matchmaking_time=2.0,
            request_timeout=1.0,
            allreduce_timeout=120.0,
            sender_timeout=30.0,
            reducer_timeout=60.0,
            next_chunk_timeout=30.0,
            compression=compression,
            start=True,
        )
        out: dict[str, Any] = {"rank": args.rank, "kind": kind}
        try:
            got = averager.step(timeout=180.0)
            if kind == "flotilla":
                out.update(seconds=got.seconds, group=len(got.contributors),
                           reverted=len(got.reverted))  # fmt: skip
            else:
                out.update(seconds=got["seconds"], group=got["size"], reverted=0)
        except Exception as exc:
            out.update(error=f"{type(exc).__name__}: {exc}"[:200])
        averager.shutdown()
        print(json.dumps(out), flush=True)
    dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
