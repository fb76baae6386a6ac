"""docs/secure-aggregation.md's example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "secure-aggregation.md"

pytestmark = pytest.mark.timeout(60)


def test_the_in_process_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], str(PAGE), "exec"), {"__name__": "secagg_page"})
