"""Fixtures only; the helpers they use live in ``tests/support``."""

from __future__ import annotations

import multiprocessing.util
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.support.databases import (
    database_params,
    database_url,
    deployment_database,
    empty_database,
    open_empty_store,
)
from tests.support.processes import AgentFleet, ServerProcess

if TYPE_CHECKING:
    from flotilla.server.federation.store import Store
    from tests.support.base_venv import BaseVenv
    from tests.support.inproc import InProcessFederation

# Many agents share a couple of cores here: one math thread each, or torch's spinning
# thread pools fight over the cores and a 5 ms step takes 50 ms. Set before any test
# imports torch; agents and servers inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def private_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """This test process's temporary files, and those of every process it starts, in one
    short directory removed at the end: a process killed with SIGKILL cannot remove its
    own (an agent's hivemind identity, say). Short, because UNIX sockets made there must
    fit 107 bytes. pytest's own ``tmp_path`` directories stay where they were."""
    tmp_path_factory.getbasetemp()  # settled before the default temporary directory moves
    # multiprocessing's own directory too: it removes that itself at exit, after this ends.
    multiprocessing.util.get_temp_dir()
    path = Path(tempfile.mkdtemp(prefix="fl-t-"))
    path.chmod(0o711)  # others may pass through: a private PostgreSQL runs as its own user
    env, default = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = str(path)
    try:
        yield path
    finally:
        if env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = env
        tempfile.tempdir = default
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=database_params())
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A server's database, once per database (see ``tests.support.databases``): for a
    store, a live gRPC server or an in-process federation. A shared PostgreSQL database is
    emptied by whoever opens it (``open_empty_store``, ``live_server``,
    ``in_process_federation``)."""
    return database_url(request.param, tmp_path)


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[Store]:
    """An open, empty :class:`Store` on each database."""
    s = await open_empty_store(db_url)
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def in_process(db_url: str, tmp_path: Path) -> AsyncIterator[InProcessFederation]:
    """The server core on each database, in this event loop; start real agents on it with
    ``start_agents`` (``tests.support.inproc``). No sockets, no subprocesses."""
    from tests.support.inproc import in_process_federation

    async with in_process_federation(tmp_path / "state", db_url) as fed:
        yield fed


@pytest.fixture
def process_db_url(tmp_path: Path) -> str:
    """The database of a real ``flotilla server`` process (``deployment_database``), empty."""
    url = database_url(deployment_database(), tmp_path)
    empty_database(url)
    return url


@pytest.fixture
def server(tmp_path: Path, process_db_url: str) -> Iterator[ServerProcess]:
    """A real ``flotilla server`` process."""
    srv = ServerProcess(tmp_path / "state", process_db_url)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def fleet(server: ServerProcess, tmp_path: Path) -> Iterator[AgentFleet]:
    """Real ``flotilla client`` processes for ``server`` (started by the test)."""
    agents = AgentFleet(server, server.token(), tmp_path)
    yield agents
    agents.stop()


@pytest.fixture
def digits_spec() -> Path:
    return Path(__file__).resolve().parent.parent / "examples" / "digits.toml"


@pytest.fixture(scope="session")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> BaseVenv:
    """A venv with only ``pip install flotilla`` (no extras), made once per session."""
    from tests.support.base_venv import make_base_venv

    return make_base_venv(tmp_path_factory.mktemp("base-venv") / "venv")


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> Iterator[None]:
    """``--dist loadgroup`` sends each ``xdist_group`` to one worker by a ``@group`` suffix
    on the test id. pytest-xdist 3.8 writes that suffix to ``item._nodeid``, which pytest 9
    no longer reads (ids live in ``item._id``), so every group was spread over all workers:
    module-scoped runs ran once per worker and hivemind swarms overlapped. This sets the
    suffix where pytest 9 keeps it, after every other hook ran (and only where missing)."""
    yield
    if not config.getoption("loadgroup", False):  # set on xdist's workers under loadgroup
        return
    from _pytest.nodeid import coerce_node_id

    for item in items:
        names = {
            str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
            for mark in item.iter_markers("xdist_group")
        }
        if names and "@" not in item.nodeid.rsplit("]", 1)[-1]:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(sorted(names))}")
