"""One peer of benchmarks/p2p.py: on each stdin line ``KIND ROUND``, all-reduce a seeded
tensor through raw hivemind (``raw``) or flotilla's SafeAverager (``flotilla``) and print
one JSON line with when its aggregation phase began and ended (wall clock, so the
benchmark can take the group's span; matchmaking excluded). ``ready`` when started."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager


class Timed:
    """Mixin: record the wall-clock span of the aggregation phase, the same for both kinds."""

    async def _aggregate_with_group(self, group_info: Any, min_vector_size: int, **kw: Any) -> Any:
        began = time.time()
        result = await super()._aggregate_with_group(group_info, min_vector_size, **kw)  # type: ignore[misc]
        # Sent back to the caller's process with the result (the averager runs in its own).
        return {"began": began, "ended": time.time(), "result": result}


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

    class TimedRaw(Timed, DecentralizedAverager):  # type: ignore[misc]
        pass

    class TimedSafe(Timed, SafeAverager):  # type: ignore[misc]
        pass

    dht = start_dht(args.initial_peers)
    compression = hivemind_compression(args.compression)
    print("ready", flush=True)
    for line in sys.stdin:
        kind, round_ = line.split()
        tensor = torch.randn(args.size, generator=torch.Generator().manual_seed(args.rank))
        cls = TimedSafe if kind == "flotilla" else TimedRaw
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
            result = got["result"]
            out.update(began=got["began"], ended=got["ended"])
            if kind == "flotilla":
                out.update(group=len(result.contributors), reverted=len(result.reverted))
            else:
                out.update(group=len(result), reverted=0)
        except Exception as exc:
            out.update(error=f"{type(exc).__name__}: {exc}"[:200])
        averager.shutdown()
        print(json.dumps(out), flush=True)
    dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
