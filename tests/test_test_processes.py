"""The suite's own hygiene: every process a test starts dies with the test run."""

from __future__ import annotations

import ast
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.lifetime import bound

TESTS = Path(__file__).resolve().parent
SPAWNERS = {("subprocess", "Popen"), ("subprocess", "run"), ("asyncio", "create_subprocess_exec")}


def _is_bound(arg: ast.expr) -> bool:
    if isinstance(arg, ast.Starred):  # create_subprocess_exec(*bound([...]))
        arg = arg.value
    return isinstance(arg, ast.Call) and getattr(arg.func, "id", "") == "bound"


def _spawn_calls(path: Path) -> list[tuple[int, bool]]:
    """(line, argv is bound) for each process-starting call in a test module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        if isinstance(owner, ast.Name) and (owner.id, node.func.attr) in SPAWNERS:
            out.append((node.lineno, bool(node.args) and _is_bound(node.args[0])))
    return out


def test_every_process_a_test_starts_is_bound_to_the_test_run() -> None:
    """A process started without the death signal outlives a killed pytest (kill -9)."""
    unbound = [
        f"{path.relative_to(TESTS)}:{line}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, ok in _spawn_calls(path)
        if not ok
    ]
    assert not unbound, f"processes started without bound(argv): {unbound}"


@pytest.mark.timeout(30)
def test_a_child_dies_when_the_process_that_started_it_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    # The middle process starts a sleeper bound to it, then is SIGKILLed, as pytest may be.
    middle = subprocess.Popen(
        bound(
            [
                sys.executable,
                "-c",
                "import subprocess, time\n"
                "from tests.support.lifetime import bound\n"
                "p = subprocess.Popen(bound(['sleep', '60']))\n"
                f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
                "time.sleep(60)\n",
            ]
        ),
        cwd=TESTS.parent,
    )
    deadline = time.monotonic() + 20
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the middle process never started its child"
        time.sleep(0.05)
    sleeper = int(pid_file.read_text())
    middle.send_signal(signal.SIGKILL)
    middle.wait(10)
    while _alive(sleeper):
        assert time.monotonic() < deadline, "the child outlived the process that started it"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"  # a zombie is dead, waiting to be reaped
    except FileNotFoundError:
        return False
