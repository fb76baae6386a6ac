"""Device identity, revocation, enrolment-token limits and the refusal record.

- ``devices.public_key``: the hex Ed25519 public key a device registered at enrolment;
  every update it sends is signed with the matching private key. Devices enrolled before
  this revision have none (``""``) and must enrol again before their updates count.
- ``devices.revoked_at``: set by ``flotilla devices revoke``; a revoked device's
  credential and key stop working at once.
- ``enrol_tokens.uses_left`` / ``expires_at`` / ``revoked_at``: a token admits at most
  ``uses_left`` enrolments (NULL: unlimited) until ``expires_at`` (NULL: never) unless
  revoked. Tokens made before this revision stay unlimited and never expire.
- ``refusals``: every update the server refused, with its reason, for the operator and the
  audit trail (an in-memory counter forgets them at restart).

Revision ID: 0006_security
Revises: 0005_device_class
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_security"
down_revision = "0005_device_class"
branch_labels = None
depends_on = None


def _columns(table: str) -> set[str]:
    return {c["name"] for c in sa.inspect(op.get_bind()).get_columns(table)}


def upgrade() -> None:
    devices = _columns("devices")
    if "public_key" not in devices:
        op.add_column(
            "devices", sa.Column("public_key", sa.String(128), nullable=False, server_default="")
        )
    if "revoked_at" not in devices:
        op.add_column("devices", sa.Column("revoked_at", sa.Double(), nullable=True))
    tokens = _columns("enrol_tokens")
    for name, kind in (
        ("uses_left", sa.Integer()),
        ("expires_at", sa.Double()),
        ("revoked_at", sa.Double()),
    ):
        if name not in tokens:
            op.add_column("enrol_tokens", sa.Column(name, kind, nullable=True))
    if "refusals" not in sa.inspect(op.get_bind()).get_table_names():
        op.create_table(
            "refusals",
            sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
            sa.Column("at", sa.Double(), nullable=False),
            sa.Column("device_id", sa.String(128), nullable=False),
            sa.Column("job_id", sa.String(128), nullable=False),
            sa.Column("round", sa.Integer(), nullable=False),
            sa.Column("reason", sa.String(64), nullable=False),
            sa.Column("detail", sa.Text(), nullable=False, server_default=""),
        )
        op.create_index("ix_refusals_device_id", "refusals", ["device_id"])
        op.create_index("ix_refusals_job_id", "refusals", ["job_id"])


def downgrade() -> None:
    op.drop_index("ix_refusals_job_id", table_name="refusals")
    op.drop_index("ix_refusals_device_id", table_name="refusals")
    op.drop_table("refusals")
    for name in ("revoked_at", "expires_at", "uses_left"):
        op.drop_column("enrol_tokens", name)
    op.drop_column("devices", "revoked_at")
    op.drop_column("devices", "public_key")
