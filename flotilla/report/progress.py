"""One progress bar per job, each on its own line that never moves.

Bars and log lines share the console: a log line must go through :func:`console_write`
(the CLI's logging handler does), which clears the bars, writes the line above them and
redraws them, so nothing tears. Where the console is no terminal (a pipe, a CI log) there
are no bars, which would print a new line at every redraw: a short line per round instead.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, TextIO


def console_write(line: str, stream: TextIO | None = None) -> None:
    """Write ``line`` above any progress bars on the console (plainly when there are none)."""
    out = stream if stream is not None else sys.stderr
    try:
        from tqdm import tqdm
    except ImportError:  # a light install has no bars to keep clear of
        out.write(line + "\n")
        out.flush()
        return
    tqdm.write(line, file=out)


class JobBars:
    """A bar per job, in the order given; :meth:`update` moves one, :meth:`close` ends all.

    ``bars``: None draws bars only when ``stream`` is a terminal.
    """

    def __init__(
        self, totals: Mapping[str, int], stream: TextIO | None = None, bars: bool | None = None
    ) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._totals = dict(totals)
        self._done = dict.fromkeys(totals, 0)
        self._bars: dict[str, Any] = {}
        if bars if bars is not None else _is_terminal(self._stream):
            from tqdm import tqdm

            width = max((len(name) for name in totals), default=0)
            for position, (name, total) in enumerate(self._totals.items()):
                self._bars[name] = tqdm(
                    total=total,
                    desc=name.ljust(width),
                    position=position,
                    unit="round",
                    file=self._stream,
                    dynamic_ncols=True,
                    leave=True,
                )

    def update(self, name: str, done: int, **notes: str) -> None:
        """Job ``name`` has ``done`` rounds; ``notes`` (``accuracy="0.912"``) follow the bar.

        Without bars, a line is written each time ``done`` moves."""
        moved = done != self._done.get(name, 0)
        self._done[name] = done
        bar = self._bars.get(name)
        if bar is not None:
            bar.n = done
            if notes:
                bar.set_postfix(notes, refresh=False)
            bar.refresh()
        elif moved:
            extra = "".join(f", {key} {value}" for key, value in notes.items())
            console_write(
                f"{name}: round {done}/{self._totals.get(name, '?')}{extra}", self._stream
            )

    def close(self) -> None:
        """End every bar where it stands; the console continues below the last."""
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()

    def __enter__(self) -> JobBars:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
