"""Jobs leased one by one instead of one leader for the whole deployment.

Several server processes on one database share the jobs: ``job_leases`` says which
process runs each job (``holder``), since which change of holder (``epoch``), and until
when unless renewed (``expires_at``); every round commit checks and renews its job's lease
in the same transaction. ``servers`` lists the live processes and the devices each one's
waiting jobs lack, so idle devices move to where the work is. The single ``leadership``
row of ``0007`` is dropped.

Revision ID: 0008_job_leases
Revises: 0007_leadership
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_job_leases"
down_revision = "0007_leadership"
branch_labels = None
depends_on = None


def upgrade() -> None:
    tables = sa.inspect(op.get_bind()).get_table_names()
    if "leadership" in tables:
        op.drop_table("leadership")
    if "servers" not in tables:
        op.create_table(
            "servers",
            sa.Column("holder", sa.String(128), primary_key=True),
            sa.Column("expires_at", sa.Double(), nullable=False),
            sa.Column("wanted_json", sa.Text(), nullable=False, server_default="{}"),
        )
    if "job_leases" not in tables:
        op.create_table(
            "job_leases",
            sa.Column("job_id", sa.String(128), primary_key=True),
            sa.Column("holder", sa.String(128), nullable=False),
            sa.Column("epoch", sa.Integer(), nullable=False),
            sa.Column("expires_at", sa.Double(), nullable=False),
        )


def downgrade() -> None:
    op.drop_table("job_leases")
    op.drop_table("servers")
    op.create_table(
        "leadership",
        sa.Column("name", sa.String(32), primary_key=True),
        sa.Column("holder", sa.String(128), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.Column("grpc_address", sa.String(256), nullable=False, server_default=""),
        sa.Column("http_url", sa.String(256), nullable=False, server_default=""),
    )
