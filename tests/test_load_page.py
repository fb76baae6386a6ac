"""docs/load.md runs as written: ``flotilla bench load`` against a fresh server, the gRPC
edge, and the books it prints (nothing lost, nothing twice) checked by the page itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.docrun import REPO, run_page

#: Seconds the load run may take on a busy 2-core machine (server start, 8 s, wind-down).
BLOCK_TIMEOUT = 180.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_load_page_runs_devices_and_its_books_balance(tmp_path: Path) -> None:
    run = run_page(REPO / "docs" / "load.md", tmp_path, BLOCK_TIMEOUT)
    assert run.timed_out_block is None, "\n".join(run.output.splitlines()[-40:])
    assert run.returncode == 0, "\n".join(run.output.splitlines()[-40:])
    result = json.loads((tmp_path / "load.json").read_text())
    assert result["edge"] == "grpc" and result["enrolled"] == 16
    assert result["rounds_committed"] >= 2 and result["accepted_updates"] > 0
    assert "16 devices:" in run.output
