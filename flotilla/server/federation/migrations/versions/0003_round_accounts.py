"""Each committed round keeps its account: selected devices, failures with reasons, stale
arrivals, bytes up and down, the scheduler's decisions (``core.records.RoundAccount``).

One nullable JSON column; rounds committed before this revision keep NULL there and read
back as an empty account, so nothing is rewritten.

Revision ID: 0003_round_accounts
Revises: 0002
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_round_accounts"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    present = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("rounds")}
    if "account_json" not in present:
        op.add_column("rounds", sa.Column("account_json", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("rounds", "account_json")
