"""docs/security.md: its example runs as written and every test it cites exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "security.md"

pytestmark = pytest.mark.timeout(60)


def test_the_signed_update_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], str(PAGE), "exec"), {"__name__": "security_page"})


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
    }


def test_every_cited_test_exists_in_the_file_it_names() -> None:
    """A claim's evidence must not rot: a renamed or deleted test breaks this page."""
    text = PAGE.read_text()
    cited = 0
    for row in text.splitlines():
        current: Path | None = None
        for file, name in re.findall(r"`(?:(test_\w+\.py)::)?(test_\w+)`", row):
            if file:
                current = REPO / "tests" / file
            assert current is not None, f"{name} is cited without its file: {row[:80]}"
            assert name in _tests_in(current), f"{current.name} has no test {name}"
            cited += 1
    assert cited >= 40
