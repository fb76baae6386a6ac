"""The quickstart runs as written, and so does the runner that proves it.

Every shell block of docs/quickstart.md runs in order in one shell
(``tests.support.docrun``); the test then checks what a reader would look for: the job
completed and the model came out.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.support.docrun import REPO, parse_blocks, run_page

DOCS = REPO / "docs"
#: Seconds any one block may take (server start, a whole job) on a busy 2-core machine.
BLOCK_TIMEOUT = 120.0


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


def test_the_quickstart_skips_only_its_install_step() -> None:
    blocks = [b for b in parse_blocks((DOCS / "quickstart.md").read_text()) if b.lang]
    assert blocks and all(b.lang == "bash" for b in blocks), "every quickstart step is bash"
    skipped = [b for b in blocks if b.skip]
    assert len(skipped) == 1 and "pip install" in skipped[0].text
    assert sum(b.runs for b in blocks) >= 6


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_quickstart_block_runs_and_the_job_completes(tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(REPO / "examples")
    run = run_page(DOCS / "quickstart.md", tmp_path, BLOCK_TIMEOUT)
    assert run.timed_out_block is None, (
        f"quickstart block at line {run.timed_out_block.line} ran over {BLOCK_TIMEOUT}s:\n"
        f"{_tail(run.output)}"
    )
    assert run.returncode == 0, _tail(run.output)
    assert re.search(r"job-\w+\s+digits\s+completed", run.output), _tail(run.output)
    assert "rounds 3/3" in run.output
    accuracy = float(re.findall(r"accuracy\s+([0-9.]+)", run.output)[-1])
    assert accuracy > 0.5, f"held-out accuracy {accuracy} after three rounds"

    from safetensors.numpy import load_file

    from flotilla.tasks.digits import DigitsTask

    model = load_file(tmp_path / "model.safetensors")
    expected = {n: tuple(t.shape) for n, t in DigitsTask().build_model(0).state_dict().items()}
    assert {n: a.shape for n, a in model.items()} == expected
    assert "net.0.weight" in run.output  # the page's own look at the model printed it


def _page(tmp_path: Path, *blocks: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text("\n".join(f"```bash\n{b}\n```\n" for b in blocks))
    return page


def _dies(pid: int, within: float = 10.0) -> bool:
    """Whether ``pid`` is gone (or a zombie) within ``within`` seconds: SIGKILL is not
    instant on a loaded machine."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(60)
def test_a_failing_block_fails_the_run_and_its_background_jobs_die(tmp_path: Path) -> None:
    page = _page(tmp_path, "sleep 300 &\necho $! > sleeper.pid", "NAME=x", 'test "$NAME" = y')
    run = run_page(page, tmp_path, block_timeout=30)
    assert run.returncode != 0 and run.timed_out_block is None
    assert _dies(int((tmp_path / "sleeper.pid").read_text()))


@pytest.mark.timeout(60)
def test_a_block_over_its_deadline_is_named_and_killed(tmp_path: Path) -> None:
    page = _page(tmp_path, "true", "sleep 300 &\necho $! > sleeper.pid\nsleep 300")
    run = run_page(page, tmp_path, block_timeout=2)
    assert run.timed_out_block is not None and "sleep 300" in run.timed_out_block.text
    assert _dies(int((tmp_path / "sleeper.pid").read_text()))
