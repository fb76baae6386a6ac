"""ORM tables of the federation server.

Only column types that behave the same on SQLite and PostgreSQL are used: times are
``Double`` (REAL / DOUBLE PRECISION, never single precision), sizes ``BigInteger``, and
structured fields SQLAlchemy's ``JSON`` (PostgreSQL ``json``; text in SQLite). Every change
here needs a revision in ``migrations/versions``: ``Store.open`` builds and upgrades the
schema through those, never from these classes. Nothing outside
:mod:`flotilla.server.federation.store` should import these classes.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Double,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

#: Deterministic constraint names, so migrations and error messages are stable across backends.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

SHA256_LEN = 64
ID_LEN = 128


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class DeviceRow(Base):
    __tablename__ = "devices"

    id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    credential_hash: Mapped[str] = mapped_column(String(256))
    tasks_json: Mapped[list[str]] = mapped_column(JSON)
    profile_json: Mapped[dict[str, float]] = mapped_column(JSON)
    enrolled_at: Mapped[float] = mapped_column(Double)
    last_seen_at: Mapped[float] = mapped_column(Double)
    device_class: Mapped[str] = mapped_column(String(64), default="", server_default="")
    #: Hex Ed25519 public key registered at enrolment; "" for devices enrolled before keys.
    public_key: Mapped[str] = mapped_column(String(128), default="", server_default="")
    revoked_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    #: Task -> training samples the device holds (``DeviceProfile.samples``); NULL for
    #: devices that never reported any, read as none.
    samples_json: Mapped[dict[str, int] | None] = mapped_column(JSON, nullable=True)


class EnrolTokenRow(Base):
    """Only the hash of an enrolment token is kept, so a database leak does not leak tokens."""

    __tablename__ = "enrol_tokens"

    token_hash: Mapped[str] = mapped_column(String(256), primary_key=True)
    created_at: Mapped[float] = mapped_column(Double)
    #: Enrolments it still admits; NULL: unlimited.
    uses_left: Mapped[int | None] = mapped_column(Integer, nullable=True)
    expires_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    revoked_at: Mapped[float | None] = mapped_column(Double, nullable=True)


class OperatorTokenRow(Base):
    """A token of the operator APIs; ``scope`` is ``operator`` (everything) or ``read``."""

    __tablename__ = "operator_tokens"

    token_hash: Mapped[str] = mapped_column(String(256), primary_key=True)
    created_at: Mapped[float] = mapped_column(Double)
    scope: Mapped[str] = mapped_column(String(16), default="operator", server_default="operator")


class CheckpointRow(Base):
    """A model blob known to the server; the bytes live in the blob store under ``sha256``."""

    __tablename__ = "checkpoints"

    sha256: Mapped[str] = mapped_column(String(SHA256_LEN), primary_key=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[float] = mapped_column(Double)


class JobRow(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    name: Mapped[str] = mapped_column(String(256))
    spec_json: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16), index=True)
    rounds_total: Mapped[int] = mapped_column(Integer)
    rounds_committed: Mapped[int] = mapped_column(Integer, default=0)
    # Empty until the first round commits (or the initial model is registered), hence no FK.
    checkpoint_sha256: Mapped[str] = mapped_column(String(SHA256_LEN), default="")
    aggregator_sha256: Mapped[str] = mapped_column(String(SHA256_LEN), default="")
    scheduler_sha256: Mapped[str] = mapped_column(String(SHA256_LEN), default="")
    created_at: Mapped[float] = mapped_column(Double, index=True)
    updated_at: Mapped[float] = mapped_column(Double)
    metrics_json: Mapped[dict[str, float]] = mapped_column(JSON)


class RoundRow(Base):
    """A committed round; the composite primary key is the (job_id, round) uniqueness guard."""

    __tablename__ = "rounds"

    job_id: Mapped[str] = mapped_column(
        String(ID_LEN), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    round: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_sha256: Mapped[str] = mapped_column(
        String(SHA256_LEN), ForeignKey("checkpoints.sha256")
    )
    metrics_json: Mapped[dict[str, float]] = mapped_column(JSON)
    started_at: Mapped[float] = mapped_column(Double)
    committed_at: Mapped[float] = mapped_column(Double)
    #: ``RoundAccount.to_json()``; NULL for rounds committed before it was recorded.
    account_json: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class ParticipationRow(Base):
    """One device in one round; a device appears at most once per round."""

    __tablename__ = "participations"
    __table_args__ = (
        ForeignKeyConstraint(
            ["job_id", "round"], ["rounds.job_id", "rounds.round"], ondelete="CASCADE"
        ),
        Index("ix_participations_device_id", "device_id"),
    )

    job_id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    round: Mapped[int] = mapped_column(Integer, primary_key=True)
    # No FK to devices: simulated or since-removed devices still keep their history.
    device_id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    num_samples: Mapped[int] = mapped_column(BigInteger)
    started_at: Mapped[float] = mapped_column(Double)
    finished_at: Mapped[float] = mapped_column(Double)
    metrics_json: Mapped[dict[str, float]] = mapped_column(JSON)


class RefusalRow(Base):
    """An update the server refused, and why (``core.events.UpdateRefused`` reasons)."""

    __tablename__ = "refusals"
    __table_args__ = (
        Index("ix_refusals_device_id", "device_id"),
        Index("ix_refusals_job_id", "job_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[float] = mapped_column(Double)
    device_id: Mapped[str] = mapped_column(String(ID_LEN))
    job_id: Mapped[str] = mapped_column(String(ID_LEN))
    round: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(String(64))
    detail: Mapped[str] = mapped_column(Text, default="", server_default="")


class ServerRow(Base):
    """A server process of the deployment: alive until ``expires_at`` unless it announces
    itself again; the devices its waiting jobs lack, per task (JSON object)."""

    __tablename__ = "servers"

    holder: Mapped[str] = mapped_column(String(128), primary_key=True)
    expires_at: Mapped[float] = mapped_column(Double)
    wanted_json: Mapped[str] = mapped_column(Text, default="{}", server_default="{}")


class JobLeaseRow(Base):
    """Which server process runs a job: renewed by the holder, and by every round commit."""

    __tablename__ = "job_leases"

    job_id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    epoch: Mapped[int] = mapped_column(Integer)
    expires_at: Mapped[float] = mapped_column(Double)
