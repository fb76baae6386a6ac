"""hivemind's worker processes, made to die with the process that started them.

hivemind forks a process for each DHT node and averager. A forked worker inherits its
parent's Python signal handlers, which swallow SIGTERM there (they set an event nobody in
the child waits on), and nothing ends it when its parent is killed with kill -9: such
workers lived on, holding ports, after a crash. Every worker flotilla starts calls
:func:`die_with_parent` first, and the processes that start them stop on
:func:`stop_on_signals`, whose handler acts only in the process that installed it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

#: linux/prctl.h
PR_SET_PDEATHSIG = 1
#: How often a step that swallowed a stop signal's interrupt gets it again.
RESEND_EVERY_S = 0.2
#: How long a main thread that waits sleeps at a time: Python runs a signal's handler in
#: the main thread only, when it wakes, and a signal may be delivered to another thread.
WAKE_EVERY_S = 0.2

log = logging.getLogger(__name__)


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


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived while the main thread blocked in :meth:`StopEvent.interruptible`
    code. A KeyboardInterrupt, which no ``except Exception`` on the way up swallows and
    hivemind's retry loops (``except KeyboardInterrupt: raise``) let through."""


class StopEvent(threading.Event):
    """Set by SIGINT or SIGTERM (:func:`stop_on_signals`). A loop checks it between steps;
    a step that may block for long (a hivemind averaging round waits up to its timeout)
    runs inside :meth:`interruptible`, where the signal raises :class:`Interrupted` at once.
    With ``hard_stop_s``, a process still stopping that long after the first signal ends
    at once, with its children (:func:`end_now`)."""

    def __init__(self, hard_stop_s: float | None = None) -> None:
        super().__init__()
        self._blocked = 0
        self._hard_stop_s = hard_stop_s
        self._on_stop: list[Callable[[], None]] = []

    def on_stop(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (in a thread of its own) when a stop signal arrives: to cancel
        the waits a step is in, say, so that it returns by itself."""
        self._on_stop.append(callback)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """Run the block so that a stop signal interrupts it (main thread only)."""
        if self.is_set():
            raise Interrupted
        self._blocked += 1
        try:
            yield
        finally:
            self._blocked -= 1

    def signalled(self, sig: int | None = None) -> None:
        """The handler's part: set, arm the hard stop, start the callbacks, and interrupt a
        blocked step. With ``sig`` (the signal that arrived), a step that swallows the
        interrupt is sent ``sig`` again, to its thread, until it returns."""
        if not self.is_set():
            if self._hard_stop_s is not None:
                timer = threading.Timer(self._hard_stop_s, end_now, args=(self._hard_stop_s,))
                timer.daemon = True
                timer.start()
            for callback in self._on_stop:  # not in the handler: it may need a lock held here
                threading.Thread(target=callback, name="on-stop", daemon=True).start()
            if sig is not None and self._blocked:
                blocked = threading.get_ident()
                threading.Thread(target=self._resend, args=(blocked, sig), daemon=True).start()
        self.set()
        if self._blocked:
            raise Interrupted

    def _resend(self, thread: int, sig: int) -> None:
        """hivemind catches BaseException around some waits (an averaging round's result):
        an Interrupted raised there is logged, and the step goes on to its next wait, up to
        a round's timeout. Signal the step's thread again while it stays blocked, until one
        lands outside such a catch; to the thread itself, since a signal to the process may
        be delivered to another thread and leave the blocked one asleep."""
        while self._blocked:
            time.sleep(RESEND_EVERY_S)
            if self._blocked:
                with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
                    signal.pthread_kill(thread, sig)


def quiet_teardown() -> None:
    """From a stop signal on, what threads torn down by the stop say is routine: a
    multiprocessing fd handover cut off (EOFError printed by its server thread), a
    hivemind future whose round was abandoned ("Future exception was never retrieved",
    logged at ERROR by asyncio). Said at DEBUG instead, so that a log's ERROR lines and
    tracebacks keep meaning that something went wrong. Call it from a stop's callback."""

    def excepthook(kind: type[BaseException], value: BaseException, tb: object) -> None:
        log.debug("after the stop signal: %s: %s", kind.__name__, value)

    def thread_excepthook(args: threading.ExceptHookArgs) -> None:
        log.debug("after the stop signal, thread %s: %r", args.thread, args.exc_value)

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)


def end_now(waited_s: float) -> None:
    """A stop that has taken ``waited_s`` already: kill this process's children and exit
    (130, as after Ctrl-C) without waiting for threads that wait on peers."""
    sys.stderr.write(f"still stopping after {waited_s:.0f} s: ending now\n")
    for child in descendants(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGKILL)
    exit_now(130)


def descendants(pid: int) -> list[int]:
    """The processes below ``pid``, read from /proc (Linux; none elsewhere). Written out
    because psutil is no dependency of a base install, which imports this module."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:  # "PID (COMMAND) STATE PPID ...": the command may hold spaces and ")"
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def exit_now(status: int) -> None:
    """Exit with ``status`` once stdout and stderr are flushed, without joining threads
    still blocked on peers that will never answer (hivemind's averaging waits: the
    interpreter would join each, up to its round's timeout)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)


def stop_on_signals(hard_stop_s: float | None = None) -> StopEvent:
    """An event set by SIGINT or SIGTERM in this process. Forked workers inherit the
    handler; in them it acts as the signal's default (an event there stops nothing)."""
    stop = StopEvent(hard_stop_s)
    owner = os.getpid()

    def handle(sig: int, _frame: object) -> None:
        if os.getpid() == owner:
            stop.signalled(sig)
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
