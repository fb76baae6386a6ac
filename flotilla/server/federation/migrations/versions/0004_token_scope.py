"""Operator tokens carry a scope: ``operator`` (everything) or ``read`` (the read routes
of the HTTP API and the dashboard; ``flotilla server token create --read-only``).

One NOT NULL column with a server default: every token stored before this revision was an
operator token and reads back as one.

Revision ID: 0004_token_scope
Revises: 0003_round_accounts
Create Date: 2026-12-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_token_scope"
down_revision = "0003_round_accounts"
branch_labels = None
depends_on = None


def upgrade() -> None:
    present = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("operator_tokens")}
    if "scope" not in present:
        op.add_column(
            "operator_tokens",
            sa.Column("scope", sa.String(16), nullable=False, server_default="operator"),
        )


def downgrade() -> None:
    op.drop_column("operator_tokens", "scope")
