#!/usr/bin/env python
"""Codec speed and size: encode and decode MB/s of float32 input on one core, bytes ratio.

For each codec it encodes a standard-normal float32 tensor (10M elements; 2M with
``--quick``) into a standalone payload with ``Codec.encode`` -- the whole path: finiteness
check, quantising or selecting, safetensors framing -- and decodes it back with
``Codec.decode``. Speeds are MB of float32 input per second, best of several runs (the
machine may be shared), with the process pinned to one CPU where the OS allows.

Floors (reported, never an exit status):

- ``int8`` encode >= 200 MB/s;
- ``topk`` encode >= 200 MB/s at k = 1% and at k = 10%.

Stdout carries exactly one JSON object; a one-line summary goes to stderr.

    python benchmarks/compression.py --quick     # 2M elements, a few seconds
    python benchmarks/compression.py             # 10M elements
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from flotilla.compression import CodecContext, make_codec

#: (label, codec name, params): every codec at its defaults, top-k at two fractions.
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("none", "none", {}),
    ("fp16", "fp16", {}),
    ("bf16", "bf16", {}),
    ("int8", "int8", {}),
    ("int4", "int4", {}),
    ("qsgd", "qsgd", {}),
    ("topk_1pct", "topk", {"fraction": 0.01}),
    ("topk_10pct", "topk", {"fraction": 0.1}),
    ("randk_1pct", "randk", {"fraction": 0.01}),
]
FLOORS = [
    ("int8 encode MB/s", "int8", 200.0),
    ("topk k=1% encode MB/s", "topk_1pct", 200.0),
    ("topk k=10% encode MB/s", "topk_10pct", 200.0),
]


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _pin_one_core() -> int | None:
    """Run on one CPU: the floors are per core, whatever numpy or BLAS might spread."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return cpu


def run(n: int, repeats: int) -> dict[str, Any]:
    cpu = _pin_one_core()
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    mb = x.nbytes / 1e6
    ctx = CodecContext.seeded(0)
    codecs: dict[str, Any] = {}
    for label, name, params in CASES:
        codec = make_codec(name, params)
        payload = codec.encode(x, ctx)  # warm-up, and the payload decode is timed on
        enc = _best(functools.partial(codec.encode, x, ctx), repeats)
        dec = _best(functools.partial(codec.decode, payload, max_elements=n), repeats)
        codecs[label] = {
            "codec": name,
            "params": codec.params(),
            "encode_MBps": round(mb / enc, 1),
            "decode_MBps": round(mb / dec, 1),
            "bytes": len(payload),
            "ratio": round(len(payload) / x.nbytes, 5),
        }
    floors = []
    for floor_name, label, limit in FLOORS:
        value = codecs[label]["encode_MBps"]
        floors.append({"name": floor_name, "value": value, "limit": limit, "ok": value >= limit})
    return {
        "benchmark": "compression",
        "elements": n,
        "input_MB": round(mb, 3),
        "repeats": repeats,
        "cpu": cpu,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "codecs": codecs,
        "floors": floors,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2M elements, 3 runs each")
    parser.add_argument("--elements", type=int, help="tensor size (default 10M, quick 2M)")
    parser.add_argument("--repeats", type=int, help="runs per measurement, best kept")
    args = parser.parse_args()
    n = args.elements or (2_000_000 if args.quick else 10_000_000)
    repeats = args.repeats or (3 if args.quick else 5)
    report = run(n, repeats)
    report["mode"] = "quick" if args.quick else "full"
    print(json.dumps(report))
    failed = [f["name"] for f in report["floors"] if not f["ok"]]
    speeds = ", ".join(
        f"{k} {v['encode_MBps']:.0f}/{v['decode_MBps']:.0f}" for k, v in report["codecs"].items()
    )
    print(
        f"compression ({n:,} floats, encode/decode MB/s): {speeds}; "
        f"floors {len(report['floors']) - len(failed)}/{len(report['floors'])} ok"
        + (f" (failed: {', '.join(failed)})" if failed else ""),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
