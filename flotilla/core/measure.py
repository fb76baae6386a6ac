"""What a device measures about itself before it enrols (an agent, or a torch-free device)."""

from __future__ import annotations

import os
import time

import numpy as np


def matmul_gflops(size: int = 256, seconds: float = 0.2) -> float:
    """Sustained float32 matmul throughput, a rough guide to local training speed."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    a @ b  # warm-up
    runs, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or runs == 0:
        a @ b
        runs += 1
    return 2 * size**3 * runs / elapsed / 1e9


def memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0
