"""docs/tasks.md runs as written: its task file trains, and a simulation of it completes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.docrun import REPO, parse_blocks, run_page

#: Seconds any one block may take on a busy 2-core machine.
BLOCK_TIMEOUT = 120.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_task_page_example_trains_and_simulates(tmp_path: Path) -> None:
    blocks = parse_blocks((REPO / "docs" / "tasks.md").read_text())
    assert {b.file for b in blocks if b.file} == {"iris_task.py", "iris-sim.toml"}
    run = run_page(REPO / "docs" / "tasks.md", tmp_path, BLOCK_TIMEOUT)
    assert run.timed_out_block is None, "\n".join(run.output.splitlines()[-60:])
    assert run.returncode == 0, "\n".join(run.output.splitlines()[-60:])
    assert "held out:" in run.output
    summary = json.loads((tmp_path / "iris-out" / "summary.json").read_text())
    job = summary["jobs"]["iris"]
    assert job["state"] == "completed" and job["rounds"] == 10
    assert job["final_metrics"]["accuracy"] >= 0.7, job
