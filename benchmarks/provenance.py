"""What a benchmark measured: the commit, and the tracked files that differed from it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any


def revision() -> dict[str, Any]:
    """``{"commit", "modified"}`` of this checkout; empty when git cannot say."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": head, "modified": sorted(line[3:] for line in dirty if line.strip())}
