"""The victim of ``test_orphans.py``: not collected by the suite (no ``test_`` file name),
run as its own pytest session, which that test then kills with SIGKILL.

Its one test starts what a test run starts: a real server hosting a volunteer run (hivemind
coordinator and its p2pd daemon), two agents, and a load run (its server and worker
processes); then it writes the ready file and waits to be killed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.support.lifetime import bound
from tests.support.processes import AgentFleet, ServerProcess

TASK = "flotilla.tasks.synthetic:Linear100K"
CHAR_LM = "flotilla.tasks.charlm:CharLMTask"


def test_start_everything_then_wait_to_be_killed(tmp_path: Path) -> None:
    ready = Path(os.environ["FLOTILLA_VICTIM_READY"])
    server = ServerProcess(tmp_path / "state", None, extra=("--p2p", f"lm={CHAR_LM}"))
    server.start(timeout=120)
    fleet = AgentFleet(server, server.token(), tmp_path)
    fleet.start(2, task=TASK)
    load = subprocess.Popen(
        bound([sys.executable, "-m", "flotilla", "bench", "load", "--devices", "20",
               "--duration", "600", "--workdir", str(tmp_path / "load")]),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not list((tmp_path / "load").glob("state/flotilla.db")):
        assert time.monotonic() < deadline and load.poll() is None, "the load run did not start"
        time.sleep(0.2)
    time.sleep(5.0)  # its workers start after the server
    ready.write_text(str(os.getpid()))
    time.sleep(600)
