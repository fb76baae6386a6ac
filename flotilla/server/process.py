"""Settings that belong to a federation server's whole process, applied by ``flotilla server``.

The server folds updates while it streams hundreds of transfers on the same cores. A
multi-threaded BLAS gains little there and costs much: after each call OpenBLAS's idle
workers spin for a while, and measured on 2 cores that spinning took a third of the
server's CPU in a 100-agent round. One BLAS thread leaves the cores to the transfers.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def single_threaded_blas() -> None:
    """Limit every BLAS loaded in this process (and SciPy's, loaded here) to one thread."""
    try:
        # Loaded now, so the limit reaches it. Neither package ships type hints.
        import scipy.linalg.blas  # type: ignore[import-untyped]  # noqa: F401
        from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - both ship with the server extra
        log.debug("threadpoolctl or scipy missing; BLAS threads left as they are")
        return
    threadpool_limits(limits=1, user_api="blas")
