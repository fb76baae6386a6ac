"""The federation store's schema as the previous release (commit d3fc720) created it.

Captured from ``flotilla/server/federation/schema.py`` before the Alembic migrations, with
SQLAlchemy's ``CreateTable``/``CreateIndex`` per dialect, so the upgrade test can build a
database exactly as an earlier server left it (no ``alembic_version`` table, JSON in Text).
"""

from __future__ import annotations

SQLITE: tuple[str, ...] = (
    """CREATE TABLE checkpoints (
    sha256 VARCHAR(64) NOT NULL,
    size_bytes BIGINT NOT NULL,
    created_at DOUBLE NOT NULL,
    CONSTRAINT pk_checkpoints PRIMARY KEY (sha256)
)""",
    """CREATE TABLE devices (
    id VARCHAR(128) NOT NULL,
    credential_hash VARCHAR(256) NOT NULL,
    tasks_json TEXT NOT NULL,
    profile_json TEXT NOT NULL,
    enrolled_at DOUBLE NOT NULL,
    last_seen_at DOUBLE NOT NULL,
    CONSTRAINT pk_devices PRIMARY KEY (id)
)""",
    """CREATE TABLE enrol_tokens (
    token_hash VARCHAR(256) NOT NULL,
    created_at DOUBLE NOT NULL,
    CONSTRAINT pk_enrol_tokens PRIMARY KEY (token_hash)
)""",
    """CREATE TABLE jobs (
    id VARCHAR(128) NOT NULL,
    name VARCHAR(256) NOT NULL,
    spec_json TEXT NOT NULL,
    state VARCHAR(16) NOT NULL,
    rounds_total INTEGER NOT NULL,
    rounds_committed INTEGER NOT NULL,
    checkpoint_sha256 VARCHAR(64) NOT NULL,
    aggregator_sha256 VARCHAR(64) NOT NULL,
    scheduler_sha256 VARCHAR(64) NOT NULL,
    created_at DOUBLE NOT NULL,
    updated_at DOUBLE NOT NULL,
    metrics_json TEXT NOT NULL,
    CONSTRAINT pk_jobs PRIMARY KEY (id)
)""",
    """CREATE INDEX ix_jobs_created_at ON jobs (created_at)""",
    """CREATE INDEX ix_jobs_state ON jobs (state)""",
    """CREATE TABLE operator_tokens (
    token_hash VARCHAR(256) NOT NULL,
    created_at DOUBLE NOT NULL,
    CONSTRAINT pk_operator_tokens PRIMARY KEY (token_hash)
)""",
    """CREATE TABLE rounds (
    job_id VARCHAR(128) NOT NULL,
    round INTEGER NOT NULL,
    checkpoint_sha256 VARCHAR(64) NOT NULL,
    metrics_json TEXT NOT NULL,
    started_at DOUBLE NOT NULL,
    committed_at DOUBLE NOT NULL,
    CONSTRAINT pk_rounds PRIMARY KEY (job_id, round),
    CONSTRAINT fk_rounds_job_id_jobs FOREIGN KEY(job_id)
        REFERENCES jobs (id) ON DELETE CASCADE,
    CONSTRAINT fk_rounds_checkpoint_sha256_checkpoints FOREIGN KEY(checkpoint_sha256)
        REFERENCES checkpoints (sha256)
)""",
    """CREATE TABLE participations (
    job_id VARCHAR(128) NOT NULL,
    round INTEGER NOT NULL,
    device_id VARCHAR(128) NOT NULL,
    num_samples BIGINT NOT NULL,
    started_at DOUBLE NOT NULL,
    finished_at DOUBLE NOT NULL,
    metrics_json TEXT NOT NULL,
    CONSTRAINT pk_participations PRIMARY KEY (job_id, round, device_id),
    CONSTRAINT fk_participations_job_id_round_rounds FOREIGN KEY(job_id, round)
        REFERENCES rounds (job_id, round) ON DELETE CASCADE
)""",
    """CREATE INDEX ix_participations_device_id ON participations (device_id)""",
)

POSTGRESQL: tuple[str, ...] = (
    """CREATE TABLE checkpoints (
    sha256 VARCHAR(64) NOT NULL,
    size_bytes BIGINT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    CONSTRAINT pk_checkpoints PRIMARY KEY (sha256)
)""",
    """CREATE TABLE devices (
    id VARCHAR(128) NOT NULL,
    credential_hash VARCHAR(256) NOT NULL,
    tasks_json TEXT NOT NULL,
    profile_json TEXT NOT NULL,
    enrolled_at DOUBLE PRECISION NOT NULL,
    last_seen_at DOUBLE PRECISION NOT NULL,
    CONSTRAINT pk_devices PRIMARY KEY (id)
)""",
    """CREATE TABLE enrol_tokens (
    token_hash VARCHAR(256) NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    CONSTRAINT pk_enrol_tokens PRIMARY KEY (token_hash)
)""",
    """CREATE TABLE jobs (
    id VARCHAR(128) NOT NULL,
    name VARCHAR(256) NOT NULL,
    spec_json TEXT NOT NULL,
    state VARCHAR(16) NOT NULL,
    rounds_total INTEGER NOT NULL,
    rounds_committed INTEGER NOT NULL,
    checkpoint_sha256 VARCHAR(64) NOT NULL,
    aggregator_sha256 VARCHAR(64) NOT NULL,
    scheduler_sha256 VARCHAR(64) NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    metrics_json TEXT NOT NULL,
    CONSTRAINT pk_jobs PRIMARY KEY (id)
)""",
    """CREATE INDEX ix_jobs_created_at ON jobs (created_at)""",
    """CREATE INDEX ix_jobs_state ON jobs (state)""",
    """CREATE TABLE operator_tokens (
    token_hash VARCHAR(256) NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    CONSTRAINT pk_operator_tokens PRIMARY KEY (token_hash)
)""",
    """CREATE TABLE rounds (
    job_id VARCHAR(128) NOT NULL,
    round INTEGER NOT NULL,
    checkpoint_sha256 VARCHAR(64) NOT NULL,
    metrics_json TEXT NOT NULL,
    started_at DOUBLE PRECISION NOT NULL,
    committed_at DOUBLE PRECISION NOT NULL,
    CONSTRAINT pk_rounds PRIMARY KEY (job_id, round),
    CONSTRAINT fk_rounds_job_id_jobs FOREIGN KEY(job_id)
        REFERENCES jobs (id) ON DELETE CASCADE,
    CONSTRAINT fk_rounds_checkpoint_sha256_checkpoints FOREIGN KEY(checkpoint_sha256)
        REFERENCES checkpoints (sha256)
)""",
    """CREATE TABLE participations (
    job_id VARCHAR(128) NOT NULL,
    round INTEGER NOT NULL,
    device_id VARCHAR(128) NOT NULL,
    num_samples BIGINT NOT NULL,
    started_at DOUBLE PRECISION NOT NULL,
    finished_at DOUBLE PRECISION NOT NULL,
    metrics_json TEXT NOT NULL,
    CONSTRAINT pk_participations PRIMARY KEY (job_id, round, device_id),
    CONSTRAINT fk_participations_job_id_round_rounds FOREIGN KEY(job_id, round)
        REFERENCES rounds (job_id, round) ON DELETE CASCADE
)""",
    """CREATE INDEX ix_participations_device_id ON participations (device_id)""",
)

DDL: dict[str, tuple[str, ...]] = {"sqlite": SQLITE, "postgresql": POSTGRESQL}
