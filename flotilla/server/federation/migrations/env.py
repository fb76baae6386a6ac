"""Alembic's environment for the federation store: migrate the connection we are handed.

:func:`flotilla.server.federation.migrations.upgrade` passes an open connection (from
``Store.open``, through ``run_sync``). The ``alembic`` command line works too, with
``-x url=sqlite:///path/flotilla.db`` (a synchronous URL), for writing new revisions.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine
from sqlalchemy.engine import Connection

from flotilla.server.federation.schema import Base


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=Base.metadata)
    with context.begin_transaction():
        context.run_migrations()


connection = context.config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    url = context.get_x_argument(as_dictionary=True).get("url")
    if not url:
        raise SystemExit("pass the database: alembic -x url=sqlite:///path/flotilla.db ...")
    engine = create_engine(url)
    with engine.begin() as conn:
        _run(conn)
    engine.dispose()
