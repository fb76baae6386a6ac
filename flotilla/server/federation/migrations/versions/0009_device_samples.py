"""Devices report how many training samples they hold per task (``DeviceProfile.samples``),
which selectors weigh data by; a restarted server must know them before the device polls
with a new profile.

One nullable JSON column; devices enrolled before this revision keep NULL there and read
back as having counted nothing, so nothing is rewritten.

Revision ID: 0009_device_samples
Revises: 0008_job_leases
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_device_samples"
down_revision = "0008_job_leases"
branch_labels = None
depends_on = None


def upgrade() -> None:
    present = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("devices")}
    if "samples_json" not in present:
        op.add_column("devices", sa.Column("samples_json", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("devices", "samples_json")
