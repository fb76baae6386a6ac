"""docs/protocol.md runs as written: a server starts, curl enrols a device and polls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.docrun import REPO, run_page

#: Seconds any one block may take on a busy 2-core machine.
BLOCK_TIMEOUT = 60.0


@pytest.mark.timeout(200)
def test_the_protocol_page_enrols_and_polls_with_curl(tmp_path: Path) -> None:
    run = run_page(REPO / "docs" / "protocol.md", tmp_path, BLOCK_TIMEOUT)
    assert run.timed_out_block is None, "\n".join(run.output.splitlines()[-40:])
    assert run.returncode == 0, "\n".join(run.output.splitlines()[-40:])
    enrolment = json.loads((tmp_path / "enrol.json").read_text())
    assert enrolment["device_id"].startswith("dev-") and enrolment["protocol"] == 1
    assert '{"protocol":1,"task":null}' in run.output
