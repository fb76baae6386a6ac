"""Alembic migrations of the federation store's schema, run by :func:`upgrade`.

- ``env.py``: Alembic's environment; it migrates the connection it is handed.
- ``versions/``: one revision per schema change. ``0001`` is the schema every release
  before migrations created; ``0002`` turns JSON kept in Text columns into SQLAlchemy's
  ``JSON`` type; ``0003_round_accounts`` adds each round's account (selected, failures,
  stale, bytes, decisions) as a nullable JSON column; ``0004_token_scope`` gives each
  operator token a scope (``operator`` or ``read``); ``0005_device_class`` keeps the class
  a device says it is (``phone``, ``sbc``...), which jobs may select by; ``0006_security``
  adds device keys and revocation, enrolment-token limits and the table of refused updates;
  ``0007_leadership`` a leader lease for the whole deployment, which ``0008_job_leases``
  replaces with one lease per job and a table of the live server processes;
  ``0009_device_samples`` keeps the training samples each device holds per task.

A database made before migrations existed (tables, but no ``alembic_version``) is adopted:
the columns those releases added in place are added if missing, the baseline is stamped,
then it is upgraded like any other.
"""

from __future__ import annotations

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import inspect
from sqlalchemy.engine import Connection

log = logging.getLogger(__name__)

#: The revision a database made before migrations is stamped with.
BASELINE = "0001"
HEAD = "0009_device_samples"
#: Columns earlier releases added to existing tables in place (constant default, NOT NULL).
LEGACY_COLUMNS = (("jobs", "aggregator_sha256"), ("jobs", "scheduler_sha256"))
#: PostgreSQL advisory lock key ("flotilla" in ASCII): servers starting together migrate
#: one at a time. SQLite needs none: the migration runs in a write (IMMEDIATE) transaction.
_PG_LOCK = 0x666C6F74696C6C61


def config(connection: Connection) -> Config:
    """Alembic's configuration for this package, migrating ``connection``."""
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).parent))
    cfg.attributes["connection"] = connection
    return cfg


def upgrade(connection: Connection) -> None:
    """Bring the database behind ``connection`` to the newest schema (creating it if empty)."""
    cfg = config(connection)
    if connection.dialect.name == "postgresql":  # held until the caller's transaction ends
        connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_LOCK})")
    tables = set(inspect(connection).get_table_names())
    if "alembic_version" not in tables and "jobs" in tables:
        log.info("adopting a database from before schema migrations")
        _add_legacy_columns(connection)
        command.stamp(cfg, BASELINE)
    command.upgrade(cfg, "head")


def _add_legacy_columns(connection: Connection) -> None:
    inspector = inspect(connection)
    for table, column in LEGACY_COLUMNS:
        present = {c["name"] for c in inspector.get_columns(table)}
        if column not in present:
            connection.exec_driver_sql(
                f"ALTER TABLE {table} ADD COLUMN {column} VARCHAR(64) NOT NULL DEFAULT ''"
            )
