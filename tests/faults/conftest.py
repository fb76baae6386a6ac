"""Fixtures of the fault suite: ``cluster``, a PostgreSQL cluster of the test's own, and
``sqlite_server``, a real server process on SQLite in the test's state directory."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.postgres import cluster
from tests.support.processes import ServerProcess

__all__ = ["cluster", "sqlite_server"]


@pytest.fixture
def sqlite_server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path / "state", None, extra=("--liveness", "20"))
    srv.start()
    yield srv
    srv.stop()
