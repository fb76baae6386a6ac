"""Run a docs page's shell blocks as a reader would, so the page stays true.

The blocks run in order in one ``bash`` (so a variable one block sets is there for the
next), in a scratch directory, with ``flotilla`` and ``python`` on ``PATH`` running this
checkout. Two HTML comments, each on the line right above a fenced block, steer it:

- ``<!-- docs-file: NAME -->``: the block is a file the reader saves; it is written as
  ``NAME`` before the shell blocks run.
- ``<!-- docs-test: skip (why) -->``: the block is not run (an install step, say).

Every block has its own deadline. The shell leads its own process group, and the group is
killed at the end whatever happened, so a server a block started with ``&`` never
outlives the test; every ``flotilla``/``python`` it starts is also bound to its shell's
life (``tests.support.lifetime``), for when pytest itself is killed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.lifetime import DIE_WITH_PARENT, bound

REPO = Path(__file__).resolve().parents[2]
SHELLS = ("bash", "sh")
FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"^<!--\s*docs-(file|test):\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: its language, text, and what its marker asks."""

    lang: str
    text: str
    line: int
    file: str = ""
    skip: str = ""

    @property
    def runs(self) -> bool:
        return self.lang in SHELLS and not self.skip and not self.file


@dataclass(frozen=True)
class DocRun:
    """What running a page's blocks did."""

    returncode: int
    output: str
    timed_out_block: Block | None


def parse_blocks(markdown: str) -> list[Block]:
    """Every top-level fenced block, with the marker on the line above it, if any."""
    blocks: list[Block] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            i += 1
        marker = MARKER.match(lines[start - 1]) if start > 0 else None
        kind, value = marker.groups() if marker else ("", "")
        blocks.append(
            Block(
                lang=opened.group(1),
                text="\n".join(lines[start + 1 : i]) + "\n",
                line=start + 1,
                file=value if kind == "file" else "",
                skip=value if kind == "test" else "",
            )
        )
        i += 1
    return blocks


def _shims(directory: Path) -> Path:
    """``flotilla`` and ``python`` commands that run this checkout with this interpreter."""
    directory.mkdir(parents=True, exist_ok=True)
    prefix = " ".join(shlex.quote(part) for part in (*DIE_WITH_PARENT, sys.executable))
    for name, args in (("flotilla", '-m flotilla "$@"'), ("python", '"$@"')):
        shim = directory / name
        shim.write_text(f"#!/bin/sh\nexec {prefix} {args}\n")
        shim.chmod(0o755)
    return directory


def _script(blocks: list[Block], progress: Path) -> str:
    """One bash script: each block announced in ``progress``, then run; jobs killed at exit."""
    parts = [
        "set -euo pipefail",
        "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT",
    ]
    for index, block in enumerate(blocks):
        if block.runs:
            parts += [f"echo {index} > {shlex.quote(str(progress))}", block.text]
    parts.append(f"echo done > {shlex.quote(str(progress))}")
    return "\n".join(parts) + "\n"


def run_page(
    page: Path, workdir: Path, block_timeout: float, environ: dict[str, str] | None = None
) -> DocRun:
    """Write the page's files into ``workdir`` and run its shell blocks there, in order,
    in ``environ`` (this process's environment by default)."""
    blocks = parse_blocks(page.read_text())
    for block in blocks:
        if block.file:
            (workdir / block.file).write_text(block.text)
    progress = workdir / ".docrun-progress"
    script = workdir / ".docrun.sh"
    script.write_text(_script(blocks, progress))
    log = workdir / ".docrun.log"
    base = os.environ if environ is None else environ
    env = {
        **base,
        "PATH": f"{_shims(workdir / '.docrun-bin')}{os.pathsep}{base.get('PATH', '')}",
        "PYTHONPATH": str(REPO),
    }
    with log.open("w") as out:
        proc = subprocess.Popen(
            bound(["bash", str(script)]),
            cwd=workdir,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            stuck = _wait(proc, blocks, progress, block_timeout)
        finally:
            _kill_group(proc)
    return DocRun(proc.returncode, log.read_text(), stuck)


def _wait(
    proc: subprocess.Popen[bytes], blocks: list[Block], progress: Path, block_timeout: float
) -> Block | None:
    """Wait for the script; the block that outlived its deadline, or None."""
    current, since = "", time.monotonic()
    while proc.poll() is None:
        now = progress.read_text().strip() if progress.exists() else ""
        if now != current:
            current, since = now, time.monotonic()
        elif time.monotonic() - since > block_timeout and current.isdigit():
            return blocks[int(current)]
        time.sleep(0.1)
    return None


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the shell's whole process group (its background jobs too), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
