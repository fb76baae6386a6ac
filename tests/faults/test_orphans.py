"""Kill -9 a whole test session: nothing it started, however deep, is left running.

A pytest session (``victim_session.py``) starts a server hosting a volunteer run (a
hivemind coordinator and its p2pd daemon), agents, and a load run with its own server and
worker processes. Every process inherits a marker in its environment. The session's root
process is killed with SIGKILL, as a CI runner or an operator's Ctrl-\\ would; within a
bounded time no process carrying the marker may remain: each is bound to its parent's life
(``setpriv --pdeathsig``, ``PR_SET_PDEATHSIG``) down the whole tree.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.support.lifetime import bound

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
MARKER = "FLOTILLA_ORPHAN_MARKER"
READY_TIMEOUT_S = 240.0
GONE_WITHIN_S = 30.0


def marked(tag: str) -> dict[int, str]:
    """pid -> command line of every live process whose environment carries ``tag``."""
    needle = f"{MARKER}={tag}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            stat = (entry / "stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                continue  # a zombie: dead, waiting to be reaped
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found[int(entry.name)] = cmd.strip()[:160]
    return found


def test_killing_a_test_session_with_sigkill_leaves_no_process_behind(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    ready = tmp_path / "ready"
    env = {**os.environ, MARKER: tag, "FLOTILLA_VICTIM_READY": str(ready),
           "FLOTILLA_CACHE_DIR": str(tmp_path / "cache")}  # fmt: skip
    env.pop("PYTEST_XDIST_WORKER", None)
    session = subprocess.Popen(
        bound([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
               "--basetemp", str(tmp_path / "victim"), "tests/faults/victim_session.py"]),
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready.exists():
        assert session.poll() is None, "the victim session ended before it was ready"
        assert time.monotonic() < deadline, "the victim session never got ready"
        time.sleep(0.2)
    # Its server, the volunteer run's coordinator and p2pd, agents, the load run's server
    # and workers: the tree this test is about (on a loaded machine the last of them can
    # start after the session said it was ready).
    deadline = time.monotonic() + 60.0
    while True:
        before = marked(tag)
        commands = " ".join(before.values())
        grown = "p2pd" in commands and "flotilla.loadgen.worker" in commands
        if (grown and len(before) >= 8) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert "p2pd" in commands and "flotilla.loadgen.worker" in commands, before
    assert len(before) >= 8, before

    session.send_signal(signal.SIGKILL)
    session.wait(10)
    deadline = time.monotonic() + GONE_WITHIN_S
    while left := marked(tag):
        if time.monotonic() > deadline:
            for pid in left:  # do not leave them to the next test either
                os.kill(pid, signal.SIGKILL)
            pytest.fail(f"left running {GONE_WITHIN_S}s after the session was killed: {left}")
        time.sleep(0.2)
