"""hivemind's log lines about peers that left, said once instead of a traceback a second.

When a volunteer leaves, the DHT still lists it as a source of the run's state until its
entry expires, and every state download that picks it (the coordinator checkpoints each
tick) makes hivemind log an ERROR with a full traceback of the failed dial. That is news
once per peer, and not an error: the next peer answers, or the next tick retries.
"""

from __future__ import annotations

import logging
import re

#: The hivemind logger that reports failed state downloads (hivemind 1.1.12).
AVERAGER_LOGGER = "hivemind.averaging.averager"


class DepartedPeers(logging.Filter):
    """A failed state download from a peer becomes one WARNING line, once per peer,
    without the traceback; every other record passes untouched."""

    PATTERN = re.compile(r"Failed to download state from (\S+)")

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        found = self.PATTERN.match(record.getMessage())
        if found is None:
            return True
        peer = found.group(1)
        if peer in self._seen:
            return False
        self._seen.add(peer)
        record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        record.msg, record.args = f"could not download the run's state from {peer} (it left?)", ()
        record.exc_info, record.exc_text = None, None
        return True


def quiet_departed_peers() -> None:
    """Install :class:`DepartedPeers` in this process, before hivemind forks its averagers
    (they inherit it)."""
    logger = logging.getLogger(AVERAGER_LOGGER)
    if not any(isinstance(f, DepartedPeers) for f in logger.filters):
        logger.addFilter(DepartedPeers())
