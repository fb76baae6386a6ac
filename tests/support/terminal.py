"""A command on a pseudo-terminal, and the screen it leaves: what a person would see.

Progress bars redraw in place with carriage returns and cursor moves, so the raw bytes
say little; :func:`render` replays them on a grid (the few controls tqdm and our console
use: CR, LF, backspace, cursor up/down, erase in line or display) and returns the lines a
terminal would show, scrollback included.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tests.support.lifetime import bound

_CSI = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")


@dataclass(frozen=True)
class TerminalRun:
    returncode: int
    #: Everything written, as bytes decoded (escape sequences kept).
    raw: str

    @property
    def screen(self) -> list[str]:
        return render(self.raw)


def run_on_terminal(
    argv: Sequence[str],
    timeout: float,
    columns: int = 120,
    interrupt_at: str | None = None,
    before_interrupt: Callable[[str], None] | None = None,
) -> TerminalRun:
    """Run ``argv`` with stdin, stdout and stderr on one pseudo-terminal of ``columns``.

    Once ``interrupt_at`` has been written, ``before_interrupt`` is called with everything
    written so far, and the command gets SIGINT (Ctrl-C)."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {**os.environ, "COLUMNS": str(columns), "LINES": "50"}
    proc = subprocess.Popen(bound(argv), stdin=child, stdout=child, stderr=child, env=env)
    os.close(child)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 0.2)
            if ready:
                try:
                    data = os.read(main, 65536)
                except OSError:  # EIO: every writer has gone
                    break
                if not data:
                    break
                chunks.append(data)
                raw = b"".join(chunks).decode(errors="replace")
                if interrupt_at is not None and interrupt_at in raw:
                    interrupt_at = None
                    if before_interrupt is not None:
                        before_interrupt(raw)
                    proc.send_signal(signal.SIGINT)
            elif proc.poll() is not None:
                break
        else:
            raise AssertionError(f"{' '.join(argv)} still running after {timeout}s")
        return TerminalRun(proc.wait(10), b"".join(chunks).decode(errors="replace"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(main)


def render(raw: str) -> list[str]:
    """The lines a terminal shows after ``raw``, scrollback included, trailing blanks cut."""
    lines: list[list[str]] = [[]]
    row = col = 0
    i = 0
    while i < len(raw):
        ch = raw[i]
        if ch == "\x1b":
            match = _CSI.match(raw, i)
            if match:
                row, col = _control(lines, row, col, match.group(1), match.group(2))
                i = match.end()
                continue
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row += 1
            col = 0  # a pty's output translates LF to CR LF
        elif ch == "\b":
            col = max(0, col - 1)
        elif ch >= " ":
            while len(lines) <= row:
                lines.append([])
            line = lines[row]
            line.extend(" " * (col + 1 - len(line)))
            line[col] = ch
            col += 1
        i += 1
    while len(lines) <= row:
        lines.append([])
    out = ["".join(line).rstrip() for line in lines]
    while out and not out[-1]:
        out.pop()
    return out


def _control(lines: list[list[str]], row: int, col: int, params: str, op: str) -> tuple[int, int]:
    n = int(params) if params.isdigit() else 1
    while len(lines) <= row:
        lines.append([])
    if op == "A":
        row = max(0, row - n)
    elif op == "B":
        row += n
    elif op == "F":  # to the start of a line n up
        row, col = max(0, row - n), 0
    elif op == "K":
        line = lines[row]
        if params in ("", "0"):
            del line[col:]
        else:
            lines[row] = [] if params == "2" else [" "] * col + line[col:]
    elif op == "J" and params in ("", "0"):
        del lines[row][col:]
        del lines[row + 1 :]
    return row, col
