"""Ctrl-C in a process that waits on peers (flotilla.core.lifetime.StopEvent): a blocked
step is interrupted or its waits cancelled at once, and a stop that still hangs ends the
process and its children within the hard-stop time, exit status 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from flotilla.core.lifetime import Interrupted, StopEvent, stop_on_signals
from tests.support.lifetime import bound


def test_a_stop_signal_interrupts_a_blocked_step_and_later_steps_do_not_start() -> None:
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    stop = stop_on_signals()
    try:
        threading.Timer(0.2, os.kill, args=(os.getpid(), signal.SIGTERM)).start()
        began = time.monotonic()
        with pytest.raises(Interrupted), stop.interruptible():
            threading.Event().wait(30)  # an averaging round that would wait out its timeout
        assert stop.is_set() and time.monotonic() - began < 5
        with pytest.raises(Interrupted), stop.interruptible():
            raise AssertionError("a step started after the stop")
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@pytest.mark.timeout(60)
def test_a_step_that_swallows_the_interrupt_gets_it_again_until_it_returns() -> None:
    """hivemind's optimizer step catches BaseException around its gradient round and then
    waits for its state round: the stop must not wait that out."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    stop = stop_on_signals()
    swallowed: list[BaseException] = []
    try:
        threading.Timer(0.2, os.kill, args=(os.getpid(), signal.SIGINT)).start()
        began = time.monotonic()
        with pytest.raises(Interrupted), stop.interruptible():
            try:
                threading.Event().wait(30)  # the gradient round's result
            except BaseException as exc:  # logged by hivemind, and the step goes on
                swallowed.append(exc)
            threading.Event().wait(30)  # the state round's
        assert [type(e) for e in swallowed] == [Interrupted]
        assert time.monotonic() - began < 5
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_outside_a_step_the_signal_only_sets_the_event() -> None:
    stop = StopEvent()
    stop.signalled()
    assert stop.is_set()


def test_callbacks_run_once_in_their_own_thread_on_the_first_signal() -> None:
    stop = StopEvent()
    called: list[str] = []
    done = threading.Event()

    def cancel_rounds() -> None:
        called.append(threading.current_thread().name)
        done.set()

    stop.on_stop(cancel_rounds)
    stop.signalled()
    stop.signalled()
    assert done.wait(5)
    time.sleep(0.1)
    assert called == ["on-stop"]


HANGING = textwrap.dedent(
    """
    import subprocess, sys, threading
    from flotilla.core.lifetime import stop_on_signals
    stop = stop_on_signals(hard_stop_s=1.0)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, flush=True)
    stop.wait()
    threading.Event().wait()  # a goodbye that never ends (hivemind waiting on a round)
    """
)


@pytest.mark.timeout(60)
def test_a_stop_that_hangs_ends_the_process_and_its_children_after_the_hard_stop_time() -> None:
    proc = subprocess.Popen(
        bound([sys.executable, "-c", HANGING]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        child = psutil.Process(int(proc.stdout.readline()))
        began = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 130
        took = time.monotonic() - began
        assert 0.9 <= took < 5, took
        child.wait(timeout=5)  # killed with its parent, not orphaned
        assert not child.is_running()
        assert proc.stderr is not None
        assert "still stopping after 1 s: ending now" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_descendants_lists_children_and_grandchildren() -> None:
    from flotilla.core.lifetime import descendants

    sleeper = "import time; time.sleep(60)"
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {sleeper!r}]); time.sleep(60)"  # noqa: E501
    proc = subprocess.Popen(bound([sys.executable, "-c", code]), start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(descendants(proc.pid)) < 1:
            time.sleep(0.1)
        (grandchild,) = descendants(proc.pid)
        assert psutil.Process(grandchild).ppid() == proc.pid
        assert {proc.pid, grandchild} <= set(descendants(os.getpid()))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
