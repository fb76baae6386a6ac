"""The server process runs BLAS on one thread (idle OpenBLAS workers spin on shared cores)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.lifetime import bound

PROBE = """
import json
from threadpoolctl import threadpool_info
from flotilla.server.process import single_threaded_blas
single_threaded_blas()
print(json.dumps([(i["filepath"], i["num_threads"]) for i in threadpool_info()
                  if i["user_api"] == "blas"]))
"""


def test_single_threaded_blas_reaches_numpy_and_scipy_blas() -> None:
    out = subprocess.run(
        bound([sys.executable, "-c", PROBE]),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={"OPENBLAS_NUM_THREADS": "2", "PATH": ""},
    )
    libraries = json.loads(out.stdout)
    assert len(libraries) >= 2, libraries  # numpy's and SciPy's (loaded by the call)
    assert all(threads == 1 for _, threads in libraries), libraries
