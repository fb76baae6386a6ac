"""docs/lite-client.md runs as written: the shard command, the conditions file, the lite
client's help and the by-hand round."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.docrun import REPO, parse_blocks, run_page

#: Seconds any one block may take on a busy 2-core machine.
BLOCK_TIMEOUT = 120.0


@pytest.mark.timeout(300)
def test_the_lite_client_page_runs(tmp_path: Path) -> None:
    page = REPO / "docs" / "lite-client.md"
    assert {b.file for b in parse_blocks(page.read_text()) if b.file} == {
        "conditions.json", "one_round.py",
    }  # fmt: skip
    run = run_page(page, tmp_path, BLOCK_TIMEOUT)
    assert run.timed_out_block is None, "\n".join(run.output.splitlines()[-60:])
    assert run.returncode == 0, "\n".join(run.output.splitlines()[-60:])
    assert (tmp_path / "device0.npz").exists()
    assert "usage: flotilla-lite" in run.output
    assert "bytes of int8, train loss" in run.output
