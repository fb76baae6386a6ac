"""The databases a test runs on, in one place: SQLite always, PostgreSQL too when
``FLOTILLA_TEST_POSTGRES_URL`` names one (the param exists only then, so it is never
skipped). The PostgreSQL database is shared by every test of one pytest process (each
xdist worker has its own): whoever opens it empties it.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from flotilla.server.federation.store import Store


def _per_worker(url: str | None) -> str | None:
    """The PostgreSQL database of this pytest-xdist worker (``test_gw0``, ``test_gw1``, ...):
    a test empties the database it opens, so two workers sharing one would wipe each
    other's rows mid-test. Without xdist (or PostgreSQL) the URL is unchanged."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not url or not worker:
        return url
    import asyncpg
    from sqlalchemy.engine import make_url

    base = make_url(url)
    name = f"{base.database}_{worker}"

    async def ensure() -> None:
        conn = await asyncpg.connect(base.set(drivername="postgresql").render_as_string(False))
        try:
            if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
                await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    asyncio.run(ensure())
    return base.set(database=name).render_as_string(hide_password=False)


POSTGRES_URL = _per_worker(os.environ.get("FLOTILLA_TEST_POSTGRES_URL"))


def database_params() -> list[Any]:
    """Every database a server runs on, as pytest params (``sqlite``, ``postgresql``)."""
    params: list[Any] = [pytest.param("sqlite", id="sqlite")]
    if POSTGRES_URL:
        params.append(pytest.param("postgresql", id="postgresql", marks=pytest.mark.postgres))
    return params


def deployment_database() -> str:
    """The one database for runs too long to repeat per database (real-process end-to-end
    tests, module-wide federations): PostgreSQL when set (what a deployment runs), else
    SQLite. What they add (processes, signals, many rounds) does not depend on the
    database; every database is covered by the ``db_url`` fixture's tests."""
    return "postgresql" if POSTGRES_URL else "sqlite"


def database_url(param: str, tmp_path: Path) -> str:
    """The URL for one of :func:`database_params`: a fresh SQLite file under ``tmp_path``
    (the server's default place for it), or the test PostgreSQL database."""
    if param == "sqlite":
        return f"sqlite:///{tmp_path / 'state' / 'flotilla.db'}"
    assert POSTGRES_URL is not None
    return POSTGRES_URL


async def open_empty_store(url: str) -> Store:
    from flotilla.server.federation.store import Store

    s = await Store.open(url)
    if s.dialect == "postgresql":
        await s.wipe()
    return s


def empty_database(url: str) -> None:
    """Empty a shared PostgreSQL database before a server process opens it (SQLite files
    are fresh per test already)."""
    if not url.startswith("postgresql"):
        return

    async def wipe() -> None:
        store = await open_empty_store(url)
        await store.close()

    asyncio.run(wipe())
