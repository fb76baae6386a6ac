"""Baseline: the schema every release before migrations created (JSON in Text columns).

Revision ID: 0001
Revises:
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

SHA256 = sa.String(64)
ID = sa.String(128)


def upgrade() -> None:
    op.create_table(
        "checkpoints",
        sa.Column("sha256", SHA256, nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("sha256", name="pk_checkpoints"),
    )
    op.create_table(
        "devices",
        sa.Column("id", ID, nullable=False),
        sa.Column("credential_hash", sa.String(256), nullable=False),
        sa.Column("tasks_json", sa.Text(), nullable=False),
        sa.Column("profile_json", sa.Text(), nullable=False),
        sa.Column("enrolled_at", sa.Double(), nullable=False),
        sa.Column("last_seen_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_devices"),
    )
    for name in ("enrol_tokens", "operator_tokens"):
        op.create_table(
            name,
            sa.Column("token_hash", sa.String(256), nullable=False),
            sa.Column("created_at", sa.Double(), nullable=False),
            sa.PrimaryKeyConstraint("token_hash", name=f"pk_{name}"),
        )
    op.create_table(
        "jobs",
        sa.Column("id", ID, nullable=False),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("spec_json", sa.Text(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("rounds_total", sa.Integer(), nullable=False),
        sa.Column("rounds_committed", sa.Integer(), nullable=False),
        sa.Column("checkpoint_sha256", SHA256, nullable=False),
        sa.Column("aggregator_sha256", SHA256, nullable=False),
        sa.Column("scheduler_sha256", SHA256, nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.Column("metrics_json", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_jobs"),
    )
    op.create_index("ix_jobs_created_at", "jobs", ["created_at"])
    op.create_index("ix_jobs_state", "jobs", ["state"])
    op.create_table(
        "rounds",
        sa.Column("job_id", ID, nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("checkpoint_sha256", SHA256, nullable=False),
        sa.Column("metrics_json", sa.Text(), nullable=False),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("committed_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "round", name="pk_rounds"),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name="fk_rounds_job_id_jobs", ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["checkpoint_sha256"],
            ["checkpoints.sha256"],
            name="fk_rounds_checkpoint_sha256_checkpoints",
        ),
    )
    op.create_table(
        "participations",
        sa.Column("job_id", ID, nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("device_id", ID, nullable=False),
        sa.Column("num_samples", sa.BigInteger(), nullable=False),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("finished_at", sa.Double(), nullable=False),
        sa.Column("metrics_json", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "round", "device_id", name="pk_participations"),
        sa.ForeignKeyConstraint(
            ["job_id", "round"],
            ["rounds.job_id", "rounds.round"],
            name="fk_participations_job_id_round_rounds",
            ondelete="CASCADE",
        ),
    )
    op.create_index("ix_participations_device_id", "participations", ["device_id"])


def downgrade() -> None:
    for name in (
        "participations",
        "rounds",
        "jobs",
        "operator_tokens",
        "enrol_tokens",
        "devices",
        "checkpoints",
    ):
        op.drop_table(name)
