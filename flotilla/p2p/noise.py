"""hivemind's log lines about the ordinary events of a churning swarm, said plainly.

hivemind 1.1.12 logs two ordinary events as an ERROR with a full traceback:

- a state download that picks a peer that just left (the DHT lists it until its entry
  expires, and the coordinator checkpoints each tick): news once per peer, and not an
  error, since the next peer answers or the next tick retries;
- an averaging round that found no group or lost a member (a peer joined late, left, or
  was out of step): the optimizer goes on with local gradients, and flotilla counts the
  epochs it did average.

Both become one WARNING line without the traceback, and so do the optimizer's retried
state download, the zero-weight round of a peer that is behind, and a stream handler
hivemind's daemon client ran twice (seen with delayed averaging); matchmaking tasks
hivemind abandons are not reported as destroyed. Every other record passes untouched.
"""

from __future__ import annotations

import logging
import re

#: The hivemind logger that reports failed state downloads and rounds (hivemind 1.1.12).
AVERAGER_LOGGER = "hivemind.averaging.averager"
#: Where hivemind logs a round it gave up on (its averager's step and all-reduce, and the
#: optimizer's zero-weight round of a peer that is behind, which delayed averaging meets).
ROUND_FUNCTIONS = frozenset({"_step", "_aggregate_with_group", "_tag_along_with_zero_weight"})


def _plain(record: logging.LogRecord, message: str) -> None:
    record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
    record.msg, record.args = message, ()
    record.exc_info, record.exc_text = None, None


class DepartedPeers(logging.Filter):
    """A failed state download from a peer becomes one WARNING line, once per peer."""

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
        _plain(record, f"could not download the run's state from {peer} (it left?)")
        return True


class FailedRounds(logging.Filter):
    """A round hivemind gave up on (``logger.exception`` in its averager's step or
    all-reduce: no group, a member gone, a round flotilla reverted) becomes a WARNING line
    naming the reason, without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.funcName not in ROUND_FUNCTIONS or record.exc_info is None:
            return True
        exc = record.exc_info[1]
        reason = str(exc) or type(exc).__name__
        _plain(record, f"this epoch's averaging round failed, training goes on: {reason}")
        return True


class RetriedDownloads(logging.Filter):
    """The optimizer's "Failed to load state from peers: ..., retrying" (a peer that
    joined as another left, say) becomes a WARNING line without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info is not None and record.getMessage().startswith(
            "Failed to load state from peers"
        ):
            _plain(record, f"{record.getMessage()} (the next peer is asked)")
        return True


class HandoverRaces(logging.Filter):
    """With delayed gradient averaging, hivemind's daemon client sometimes runs a stream
    handler's coroutine twice ("Unhandled exception in client_connected_cb: cannot reuse
    already awaited coroutine"); the stream is dropped and its round retried or reverted.
    That becomes one WARNING line without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.getMessage().startswith("Unhandled exception in client_connected_cb") and (
            isinstance(exc, RuntimeError) and "cannot reuse already awaited coroutine" in str(exc)
        ):
            _plain(record, "a libp2p stream hivemind's daemon client handed over twice was dropped")
        return True


class AbandonedTasks(logging.Filter):
    """hivemind starts matchmaking requests as tasks it keeps no reference to; when one is
    cancelled (its group formed or the averager stops) and collected before it finishes,
    asyncio reports it destroyed while pending, and hivemind logs the GeneratorExit that
    ends it; closing a cancelled reader's stream fails the same way. Those records are
    dropped; a pending or failed task of anything else passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Task was destroyed but it is pending!"):
            return "/hivemind/" not in message
        if message.startswith("Task exception was never retrieved"):
            # The close of a stream generator its cancelled reader was still inside.
            return "async_generator_athrow" not in message
        return not (record.exc_info is not None and record.exc_info[0] is GeneratorExit)


#: The loggers each filter watches (hivemind 1.1.12's module loggers, and asyncio's).
FILTERS: tuple[tuple[str, type[logging.Filter]], ...] = (
    (AVERAGER_LOGGER, DepartedPeers),
    (AVERAGER_LOGGER, FailedRounds),
    ("hivemind.optim.optimizer", RetriedDownloads),
    ("hivemind.optim.optimizer", FailedRounds),
    ("hivemind.utils.asyncio", AbandonedTasks),
    ("asyncio", AbandonedTasks),
    ("asyncio", HandoverRaces),
)


def quiet_hivemind() -> None:
    """Install the filters in this process, before hivemind forks its averagers (they
    inherit them)."""
    for name, kind in FILTERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())
