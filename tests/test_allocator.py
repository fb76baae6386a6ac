"""A simulating process keeps the memory it frees: a round's model-sized buffers are
allocated again without faulting every page back in."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.lifetime import bound

# Rounds that each hold twenty 10 MiB buffers (groups' deltas, written), with small
# temporaries between them, then free them all; the page faults of five such rounds,
# before and after keep_freed_memory.
PROBE = """
import json, resource, numpy as np
from flotilla.simulation.allocator import keep_freed_memory

def round_():
    held = []
    for _ in range(20):
        held.append(np.ones(10 * 2**18, dtype=np.float32))
        np.ones(2**16, dtype=np.float32)

def faults():
    for _ in range(3):
        round_()
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        round_()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start

before = faults()
took = keep_freed_memory()
print(json.dumps({"before": before, "took": took, "after": faults()}))
"""


def test_freed_buffers_are_reused_without_page_faults() -> None:
    out = subprocess.run(
        bound([sys.executable, "-c", PROBE]), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["took"] is True
    pages = 5 * 20 * 10 * 2**20 // 4096  # every buffer of the five rounds
    assert got["before"] > pages // 10, got  # glibc gave them back, and faulted them in
    assert got["after"] < pages // 100, got
