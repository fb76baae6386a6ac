"""docs/reliability.md runs as written: a server stopped with SIGTERM exits 0, and starts
again on the same state directory. Every test the page cites exists under tests/faults/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.docrun import REPO, run_page

BLOCK_TIMEOUT = 120.0


@pytest.mark.timeout(200)
def test_the_reliability_page_stops_and_restarts_a_server(tmp_path: Path) -> None:
    run = run_page(REPO / "docs" / "reliability.md", tmp_path, BLOCK_TIMEOUT)
    assert run.timed_out_block is None, "\n".join(run.output.splitlines()[-40:])
    assert run.returncode == 0, "\n".join(run.output.splitlines()[-40:])
    assert "exited 0" in run.output and "restarted and stopped cleanly" in run.output


def test_every_fault_test_the_page_cites_exists() -> None:
    page = (REPO / "docs" / "reliability.md").read_text()
    cited = set(re.findall(r"`(test_[a-z_]+\.py)`", page))
    assert len(cited) >= 8
    here = {p.name for p in (REPO / "tests").rglob("test_*.py")}
    assert cited <= here, sorted(cited - here)
