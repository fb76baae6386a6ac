"""JSON kept in Text columns becomes SQLAlchemy's JSON type.

PostgreSQL converts each column in place (``USING column::json``). SQLite has no column
types to change (a declared type is only an affinity and JSON is stored as text either
way), so there the revision only normalises the data. On both, an empty text, which
earlier releases read as an empty object or list, becomes one, so every value parses.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

#: (table, column, what an empty text meant)
COLUMNS = (
    ("devices", "tasks_json", "[]"),
    ("devices", "profile_json", "{}"),
    ("jobs", "metrics_json", "{}"),
    ("rounds", "metrics_json", "{}"),
    ("participations", "metrics_json", "{}"),
)


def upgrade() -> None:
    bind = op.get_bind()
    postgres = bind.dialect.name == "postgresql"
    inspector = sa.inspect(bind)
    for table, column, empty in COLUMNS:
        declared = {c["name"]: c["type"] for c in inspector.get_columns(table)}[column]
        if isinstance(declared, sa.JSON):  # adopted from a database already converted
            continue
        op.execute(
            sa.text(f"UPDATE {table} SET {column} = :empty WHERE {column} = ''").bindparams(
                empty=empty
            )
        )
        if postgres:
            op.alter_column(
                table,
                column,
                type_=sa.JSON(),
                existing_type=sa.Text(),
                existing_nullable=False,
                postgresql_using=f"{column}::json",
            )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, column, _ in COLUMNS:
        op.alter_column(
            table,
            column,
            type_=sa.Text(),
            existing_type=sa.JSON(),
            existing_nullable=False,
            postgresql_using=f"{column}::text",
        )
