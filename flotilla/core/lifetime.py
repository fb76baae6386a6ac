"""hivemind's worker processes, made to die with the process that started them.

hivemind forks a process for each DHT node and averager. A forked worker inherits its
parent's Python signal handlers, which swallow SIGTERM there (they set an event nobody in
the child waits on), and nothing ends it when its parent is killed with kill -9: such
workers lived on, holding ports, after a crash. Every worker flotilla starts calls
:func:`die_with_parent` first, and the processes that start them stop on
:func:`stop_on_signals`, whose handler acts only in the process that installed it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Sequence

#: linux/prctl.h
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a freshly forked worker: SIGTERM ends it again, and so does its parent's death."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def end_with_parent() -> None:
    """For a peer a server hosts: the kernel SIGKILLs it when the server dies, however the
    server dies (a coordinator that outlived a killed server would hold the run's identity
    against the restarted one; it resumes from its last checkpoint, as after a crash)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def gone_here(host: str, pid: int) -> bool:
    """Whether ``host`` is this machine and its process ``pid`` no longer runs (never
    this process). A process of another machine is never known to be gone."""
    if host != socket.gethostname() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        return False
    return False


def stop_on_signals() -> threading.Event:
    """An event set by SIGINT or SIGTERM in this process. Forked workers inherit the
    handler; in them it acts as the signal's default (an event there stops nothing)."""
    stop = threading.Event()
    owner = os.getpid()

    def handle(sig: int, _frame: object) -> None:
        if os.getpid() == owner:
            stop.set()
            return
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)
    return stop


#: ``setpriv --pdeathsig KILL`` (util-linux), when this machine has it.
_SETPRIV = shutil.which("setpriv")


def bound(argv: Sequence[str]) -> list[str]:
    """``argv`` run so that the kernel SIGKILLs it when the process starting it ends,
    however that ends: ``setpriv --pdeathsig KILL`` execs the command in place (same pid).
    Unlike a ``preexec_fn``, it lets ``subprocess`` use ``vfork``, which grpc's fork handlers
    need in a parent with grpc threads. Without setpriv, ``argv`` as is."""
    if _SETPRIV is None or not sys.platform.startswith("linux"):
        return list(argv)
    return [_SETPRIV, "--pdeathsig", "KILL", "--", *argv]
