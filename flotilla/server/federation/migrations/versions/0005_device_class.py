"""Devices say what class of device they are (``phone``, ``sbc``, ``laptop``...): jobs may
select only some classes (``[eligibility] device_classes``), so the class must survive a
restart of the server even when the device does not send its profile again.

One NOT NULL column with a server default: devices enrolled before this revision have no
class (``""``), which no ``device_classes`` list admits.

Revision ID: 0005_device_class
Revises: 0004_token_scope
Create Date: 2026-12-12
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_device_class"
down_revision = "0004_token_scope"
branch_labels = None
depends_on = None


def upgrade() -> None:
    present = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("devices")}
    if "device_class" not in present:
        op.add_column(
            "devices",
            sa.Column("device_class", sa.String(64), nullable=False, server_default=""),
        )


def downgrade() -> None:
    op.drop_column("devices", "device_class")
