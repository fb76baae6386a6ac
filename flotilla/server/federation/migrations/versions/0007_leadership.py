"""The deployment's leader lease: which server process runs the jobs and serves devices.

``leadership`` holds one row (``name = 'deployment'``): the process holding the lease
(``holder``), its ``epoch`` (one more at every change of holder), when the lease runs out
unless renewed (``expires_at``), and where devices reach that process. Every round commit
checks and renews it in the same transaction, so a process that lost the lease can never
commit again.

Revision ID: 0007_leadership
Revises: 0006_security
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_leadership"
down_revision = "0006_security"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if "leadership" in sa.inspect(op.get_bind()).get_table_names():
        return
    op.create_table(
        "leadership",
        sa.Column("name", sa.String(32), primary_key=True),
        sa.Column("holder", sa.String(128), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.Column("grpc_address", sa.String(256), nullable=False, server_default=""),
        sa.Column("http_url", sa.String(256), nullable=False, server_default=""),
    )


def downgrade() -> None:
    op.drop_table("leadership")
