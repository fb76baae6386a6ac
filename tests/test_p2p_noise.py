"""hivemind's failed state downloads from a peer that left: one warning per peer, no
traceback (a healthy run with peers leaving writes no ERROR line for them)."""

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
