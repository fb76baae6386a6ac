"""Where every command's log lines go: short ones on the console, the details in a file.

At the default verbosity the console gets Flotilla's INFO lines (short, human) and every
warning; a command that draws progress bars hushes the loggers whose news the bars already
show (``flotilla.engine``'s line per round). ``-v`` adds Flotilla's DEBUG lines, such as
each round's whole metrics dict, and other libraries' INFO lines. ``--log-file`` gets the
details whatever the console shows. Console lines are written above the progress bars
(:func:`flotilla.report.progress.console_write`), so a log line never tears a bar.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from flotilla.core.errors import SpecError

#: The log file's lines: when, how bad, who, what.
FILE_FORMAT = "%(asctime)s %(level)s %(name)s: %(message)s"
#: The console's: the terminal has its own clock.
CONSOLE_FORMAT = "%(level)s %(name)s: %(message)s"


class ConsoleHandler(logging.Handler):
    """Writes each line to stderr above any progress bars (stderr as it is at the time, so
    a redirected stderr is honoured)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from flotilla.report.progress import console_write

            console_write(self.format(record), sys.stderr)
        except Exception:  # logging must never raise into the caller
            self.handleError(record)


class Verbosity(logging.Filter):
    """Keeps warnings from anyone; below that, only what this verbosity shows."""

    def __init__(self, verbose: bool, hushed: Sequence[str] = ()) -> None:
        super().__init__()
        self._verbose = verbose
        self._hushed = tuple(hushed)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        if not _ours(record.name):
            return self._verbose and record.levelno >= logging.INFO
        return self._verbose or not any(_under(record.name, h) for h in self._hushed)


class Details(logging.Filter):
    """A log file's share: all of Flotilla's lines, other libraries' from INFO up."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _ours(record.name) or record.levelno >= logging.INFO


_LEVELS = {10: "DEBUG", 20: "INFO", 30: "WARNING", 40: "ERROR", 50: "CRITICAL"}


class LevelFormatter(logging.Formatter):
    """Names levels itself: hivemind renames them process-wide when imported
    (``WARNING`` becomes ``WARN``), and our lines should not change with what was loaded."""

    def format(self, record: logging.LogRecord) -> str:
        record.level = _LEVELS.get(record.levelno, record.levelname)
        return super().format(record)


def setup_logging(verbose: bool, log_file: Path | None, hushed: Sequence[str] = ()) -> None:
    """Route the process's logging: the console at this verbosity, ``log_file`` in full.

    ``hushed``: loggers whose INFO lines the console leaves out at the default verbosity
    (their news is on a progress bar); they still reach the log file."""
    console = ConsoleHandler(logging.DEBUG)
    console.setFormatter(LevelFormatter(CONSOLE_FORMAT))
    console.addFilter(Verbosity(verbose, hushed))
    handlers: list[logging.Handler] = [console]
    if log_file is not None:
        try:
            file = logging.FileHandler(log_file, encoding="utf-8")
        except OSError as exc:
            raise SpecError(f"--log-file {log_file}: {exc.strerror or exc}") from exc
        file.setFormatter(LevelFormatter(FILE_FORMAT))
        file.addFilter(Details())
        handlers.append(file)
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True)
    detailed = verbose or log_file is not None
    logging.getLogger("flotilla").setLevel(logging.DEBUG if detailed else logging.NOTSET)


def _ours(name: str) -> bool:
    return _under(name, "flotilla")


def _under(name: str, parent: str) -> bool:
    return name == parent or name.startswith(parent + ".")
