"""hivemind's routine churn, said plainly: a failed state download from a peer that left
is one warning per peer, a round hivemind gave up on or a retried download is a warning
naming why, and matchmaking tasks hivemind abandons are not reported (a healthy run with
peers joining and leaving writes no ERROR line or traceback for them)."""

from __future__ import annotations

import logging

import pytest

from flotilla.p2p.noise import AVERAGER_LOGGER, DepartedPeers


def _failure(peer: str) -> logging.LogRecord:
    try:
        raise ConnectionError("failed to dial: all dials failed")
    except ConnectionError as exc:
        record = logging.LogRecord(
            AVERAGER_LOGGER, logging.ERROR, __file__, 1,
            f"Failed to download state from {peer} - {exc!r}", (), (type(exc), exc, None),
        )  # fmt: skip
    return record


def test_a_departed_peer_is_one_warning_without_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("flotilla.tests.departed")
    logger.addFilter(DepartedPeers())
    with caplog.at_level(logging.DEBUG, logger=logger.name):
        for peer in ("12D3KooWA", "12D3KooWA", "12D3KooWB", "12D3KooWA"):
            logger.handle(_failure(peer))
        logger.handle(logging.LogRecord(logger.name, logging.ERROR, __file__, 1, "other", (), None))
    said = [(r.levelno, r.getMessage(), r.exc_info) for r in caplog.records]
    assert said == [
        (logging.WARNING, "could not download the run's state from 12D3KooWA (it left?)", None),
        (logging.WARNING, "could not download the run's state from 12D3KooWB (it left?)", None),
        (logging.ERROR, "other", None),
    ]


def _exception_record(
    logger: str, func: str, message: str, exc: BaseException
) -> logging.LogRecord:
    record = logging.LogRecord(
        logger, logging.ERROR, __file__, 1, message, (), (type(exc), exc, None), func=func
    )
    return record


def test_a_round_hivemind_gave_up_on_is_a_warning_naming_the_reason() -> None:
    from hivemind.averaging.partition import AllreduceException

    from flotilla.p2p.noise import FailedRounds

    failed = FailedRounds()
    no_group = AllreduceException("Averaging step failed: could not find a group")
    record = _exception_record(AVERAGER_LOGGER, "_step", str(no_group), no_group)
    assert failed.filter(record)
    assert (record.levelno, record.exc_info) == (logging.WARNING, None)
    assert record.getMessage().endswith("could not find a group")
    reverted = RuntimeError("all-reduce incomplete: peers ['A'] did not finish cleanly")
    record = _exception_record(AVERAGER_LOGGER, "_aggregate_with_group", str(reverted), reverted)
    assert failed.filter(record) and record.levelno == logging.WARNING
    # The same logger's other errors keep their level and traceback.
    other = _exception_record(AVERAGER_LOGGER, "rpc_join_group", "boom", ValueError("boom"))
    assert failed.filter(other) and other.levelno == logging.ERROR and other.exc_info


def test_abandoned_hivemind_tasks_are_dropped_and_others_kept() -> None:
    from flotilla.p2p.noise import AbandonedTasks, RetriedDownloads

    tasks = AbandonedTasks()

    def asyncio_record(message: str) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, (), None)

    destroyed = "Task was destroyed but it is pending!\ntask: <Task pending coro=<{}>>"
    assert not tasks.filter(asyncio_record(destroyed.format("/x/hivemind/averaging/m.py:1")))
    assert tasks.filter(asyncio_record(destroyed.format("/x/flotilla/p2p/volunteer.py:1")))
    athrow = "Task exception was never retrieved\nfuture: <Task coro=<<async_generator_athrow>"
    assert not tasks.filter(asyncio_record(athrow))
    assert tasks.filter(asyncio_record("Task exception was never retrieved\nfuture: <x>"))
    closing = _exception_record("hivemind.utils.asyncio", "await_cancelled", "", GeneratorExit())
    assert not tasks.filter(closing)

    retried = RetriedDownloads()
    record = _exception_record(
        "hivemind.optim.optimizer", "load_state_from_peers",
        "Failed to load state from peers: list index out of range, retrying ...",
        IndexError("list index out of range"),
    )  # fmt: skip
    assert retried.filter(record)
    assert (record.levelno, record.exc_info) == (logging.WARNING, None)


def test_delayed_averagings_hivemind_noise_is_one_warning_line() -> None:
    """Delayed gradient averaging meets two of hivemind's errors in a healthy run: the
    zero-weight round of a peer that is behind, and a stream handler its daemon client ran
    twice; each becomes a WARNING line. Another asyncio callback error stays an ERROR."""
    from flotilla.p2p.noise import FailedRounds, HandoverRaces

    failed = RuntimeError("Unable to run All-Reduce: all-reduce incomplete")
    record = _exception_record(
        "hivemind.optim.optimizer", "_tag_along_with_zero_weight", str(failed), failed
    )
    assert FailedRounds().filter(record)
    assert (record.levelno, record.exc_info) == (logging.WARNING, None)

    races = HandoverRaces()
    twice = RuntimeError("cannot reuse already awaited coroutine")
    record = _exception_record(
        "asyncio", "call_exception_handler", "Unhandled exception in client_connected_cb", twice
    )
    assert races.filter(record) and record.levelno == logging.WARNING and not record.exc_info
    other = _exception_record(
        "asyncio", "call_exception_handler", "Unhandled exception in client_connected_cb",
        ValueError("boom"),
    )  # fmt: skip
    assert races.filter(other) and other.levelno == logging.ERROR and other.exc_info
