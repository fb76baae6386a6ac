"""Every process a test starts dies with the test run, even when pytest is killed with -9.

Pass :func:`die_with_test` as ``preexec_fn`` to ``subprocess.Popen``/``run`` (or
``asyncio.create_subprocess_exec``): the kernel sends the child SIGKILL when the process
that started it exits, however it exits. The prctl function is looked up here, in the
parent, so the child between fork and exec only makes one system call.
"""

from __future__ import annotations

import ctypes
import signal

#: linux/prctl.h
PR_SET_PDEATHSIG = 1

_prctl = ctypes.CDLL(None, use_errno=True).prctl


def die_with_test() -> None:
    """Runs in the child before exec: SIGKILL this process when its parent dies."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
