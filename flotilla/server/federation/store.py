"""The federation server's database: SQLite for one box, PostgreSQL for a fleet.

Every public method is one transaction and returns plain records from
:mod:`flotilla.core.records`, so callers never hold ORM objects or sessions. Round commits
are the one multi-row write that must be all-or-nothing; :meth:`Store.commit_round` does it
under a row lock on the job (PostgreSQL) or a write lock on the file (SQLite).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

from sqlalchemy import event, func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.pool import QueuePool
from sqlalchemy.sql.dml import Insert

from flotilla.core.commit_rules import (
    check_commit,
    check_job_state,
    check_next_round,
    check_transition,
    state_after,
)
from flotilla.core.errors import (
    AuthError,
    ConflictError,
    JobStateError,
    LeaseLost,
    NotFoundError,
    RoundConflict,
    StorageUnavailable,
)
from flotilla.core.records import (
    RESUMABLE_STATES,
    DeviceRecord,
    EnrolTokenRecord,
    JobLease,
    JobRecord,
    LeaseFence,
    ParticipationRecord,
    RefusalRecord,
    RoundAccount,
    RoundCommit,
    RoundRecord,
    ServerPresence,
)
from flotilla.core.timeouts import Timeouts
from flotilla.server.federation import migrations
from flotilla.server.federation.schema import (
    Base,
    CheckpointRow,
    DeviceRow,
    EnrolTokenRow,
    JobLeaseRow,
    JobRow,
    OperatorTokenRow,
    ParticipationRow,
    RefusalRow,
    RoundRow,
    ServerRow,
)

__all__ = [
    "ConflictError",
    "JobStateError",
    "RoundConflict",
    "Store",
    "async_url",
    "default_url",
    "token_refusal",
    "token_state",
]

#: Hex digits of a token's SHA-256 that name it in listings and revocations.
TOKEN_ID_HEX = 12
#: Longest id and refusal detail the refusals table keeps (longer ones are cut).
ID_COLUMN = 128
MAX_DETAIL = 500

# Execution option read by the SQLite "begin" hook: write transactions take the write lock
# up front so two writers queue instead of failing on a stale snapshot.
_SQLITE_BEGIN = "flotilla_sqlite_begin"


def default_url(state_dir: Path) -> str:
    """The single-box database: a SQLite file inside the server's state directory."""
    return f"sqlite+aiosqlite:///{(Path(state_dir) / 'flotilla.db').as_posix()}"


def async_url(url: str) -> URL:
    """Map ``sqlite:///...`` / ``postgresql://...`` onto the async drivers the store runs on."""
    parsed = make_url(url)
    backend, _, driver = parsed.drivername.partition("+")
    if backend == "sqlite":
        wanted = "aiosqlite"
        name = "sqlite+aiosqlite"
    elif backend in ("postgresql", "postgres"):
        wanted = "asyncpg"
        name = "postgresql+asyncpg"
    else:
        raise ValueError(
            f"unsupported database URL {parsed.render_as_string(hide_password=True)!r}: "
            "use sqlite:///path/to/flotilla.db or postgresql://user@host/db"
        )
    if driver not in ("", wanted):
        raise ValueError(
            f"database driver {driver!r} is not async; use {backend}:// or {name}:// instead"
        )
    return parsed.set(drivername=name)


def _on_sqlite_connect(busy_s: float, dbapi_connection: Any, _record: Any) -> None:
    # ``busy_s``: how long a writer waits for another before giving up ("database is
    # locked"). Take BEGIN away from the sqlite3 driver (which skips it for SELECT and DDL) so the
    # "begin" hook below controls when and how each transaction starts.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={round(busy_s * 1000)}")
    finally:
        cursor.close()


def _on_sqlite_begin(conn: Connection) -> None:
    mode = conn.get_execution_options().get(_SQLITE_BEGIN, "DEFERRED")
    conn.exec_driver_sql(f"BEGIN {mode}")


def _floats(value: Mapping[str, float]) -> dict[str, float]:
    """A fresh ``{str: float}`` for a JSON column: metrics may hold numpy scalars."""
    return {str(k): float(v) for k, v in value.items()}


def _counts(value: Mapping[str, int]) -> dict[str, int]:
    """A fresh ``{str: int}`` for a JSON column."""
    return {str(k): int(v) for k, v in value.items()}


def token_state(row: EnrolTokenRow | None, now: float) -> str:
    """``active``, ``revoked``, ``expired``, ``used up`` or ``unknown`` (no such token)."""
    if row is None:
        return "unknown"
    if row.revoked_at is not None:
        return "revoked"
    if row.expires_at is not None and row.expires_at <= now:
        return "expired"
    if row.uses_left is not None and row.uses_left <= 0:
        return "used up"
    return "active"


def token_refusal(state: str) -> str:
    """Why an enrolment was refused: the state of a token the caller holds, and nothing
    about tokens it does not (an unknown token is just refused)."""
    if state in ("revoked", "expired", "used up"):
        return f"enrolment token refused: {state}"
    return "enrolment token refused"


def _device_record(row: DeviceRow) -> DeviceRecord:
    return DeviceRecord(
        id=row.id,
        credential_hash=row.credential_hash,
        tasks=tuple(row.tasks_json),
        profile=dict(row.profile_json),
        enrolled_at=row.enrolled_at,
        last_seen_at=row.last_seen_at,
        device_class=row.device_class or "",
        public_key=row.public_key or "",
        revoked_at=row.revoked_at,
        samples={str(k): int(v) for k, v in (row.samples_json or {}).items()},
    )


def _job_lease(row: JobLeaseRow) -> JobLease:
    return JobLease(row.job_id, row.holder, row.epoch, row.expires_at)


def _presence(row: ServerRow) -> ServerPresence:
    wanted = json.loads(row.wanted_json or "{}")
    return ServerPresence(row.holder, row.expires_at, tuple(sorted(wanted.items())))


def _job_record(row: JobRow) -> JobRecord:
    return JobRecord(
        id=row.id,
        name=row.name,
        spec_json=row.spec_json,
        state=row.state,
        rounds_total=row.rounds_total,
        rounds_committed=row.rounds_committed,
        checkpoint_sha256=row.checkpoint_sha256,
        created_at=row.created_at,
        updated_at=row.updated_at,
        metrics=dict(row.metrics_json),
        aggregator_sha256=row.aggregator_sha256,
        scheduler_sha256=row.scheduler_sha256,
    )


def _participation_record(row: ParticipationRow) -> ParticipationRecord:
    return ParticipationRecord(
        job_id=row.job_id,
        round=row.round,
        device_id=row.device_id,
        num_samples=row.num_samples,
        started_at=row.started_at,
        finished_at=row.finished_at,
        metrics=dict(row.metrics_json),
    )


#: SQLSTATE classes of a database that is away, not of a wrong statement: connection
#: exceptions, insufficient resources (a full disk, too many connections), operator
#: intervention (shutting down, starting up).
_OUTAGE_SQLSTATES = ("08", "53", "57")


def _transient(exc: DBAPIError) -> bool:
    """A connection that failed or was lost, a database shutting down or starting, a full
    disk or a lock held past the busy timeout: the database, not the statement, is the
    problem."""
    if exc.connection_invalidated or isinstance(exc, OperationalError | InterfaceError):
        return True
    sqlstate = getattr(exc.orig, "sqlstate", None)
    return isinstance(sqlstate, str) and sqlstate[:2] in _OUTAGE_SQLSTATES


@asynccontextmanager
async def _storage_errors() -> AsyncIterator[None]:
    try:
        yield
    except DBAPIError as exc:
        if not _transient(exc):
            raise
        raise StorageUnavailable(f"database unavailable: {exc.orig or exc}") from exc
    except OSError as exc:  # the driver's socket, before SQLAlchemy wraps it
        raise StorageUnavailable(f"database unavailable: {exc}") from exc


@asynccontextmanager
async def _in_storage_errors(
    inner: AbstractAsyncContextManager[AsyncSession],
) -> AsyncIterator[AsyncSession]:
    async with _storage_errors(), inner as session:
        yield session


class Store:
    """Async access to the server's tables; build one with :meth:`Store.open`."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._dialect = engine.dialect.name
        write_engine = engine
        if self._dialect == "sqlite":
            write_engine = engine.execution_options(**{_SQLITE_BEGIN: "IMMEDIATE"})
        self._read = async_sessionmaker(engine, expire_on_commit=False)
        self._write = async_sessionmaker(write_engine, expire_on_commit=False)
        self._write_engine = write_engine

    # -- lifecycle -------------------------------------------------------------------------

    default_url = staticmethod(default_url)

    @classmethod
    async def open(cls, url: str, busy_s: float | None = None) -> Store:
        """Connect, and create or upgrade the schema to the newest revision (see
        :mod:`~flotilla.server.federation.migrations`); existing rows are kept. A SQLite
        writer waits ``busy_s`` (default ``Timeouts.db_busy_s``) for another's lock."""
        target = async_url(url)
        if target.get_backend_name() == "sqlite":
            db = target.database or ""
            if db and db != ":memory:" and not db.startswith("file:"):
                Path(db).parent.mkdir(parents=True, exist_ok=True)
            engine = create_async_engine(target)
            busy = Timeouts().db_busy_s if busy_s is None else busy_s
            event.listen(engine.sync_engine, "connect", partial(_on_sqlite_connect, busy))
            event.listen(engine.sync_engine, "begin", _on_sqlite_begin)
        else:
            engine = create_async_engine(target, pool_pre_ping=True)
        store = cls(engine)
        try:
            async with store._write_engine.begin() as conn:
                await conn.run_sync(migrations.upgrade)
        except BaseException:
            await engine.dispose()
            raise
        return store

    async def close(self) -> None:
        await self._engine.dispose()

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def dialect(self) -> str:
        """``"sqlite"`` or ``"postgresql"``."""
        return self._dialect

    def _writing(self) -> AbstractAsyncContextManager[AsyncSession]:
        """A write transaction; a lost database connection or a full disk is raised as
        :class:`StorageUnavailable` (the transaction rolled back, or its outcome unknown)."""
        return _in_storage_errors(self._write.begin())

    def _reading(self) -> AbstractAsyncContextManager[AsyncSession]:
        return _in_storage_errors(self._read())

    def connections_in_use(self) -> int:
        """Database connections checked out of the pool right now: flat from round to round
        under a steady load (growth is a leak; the resource-hygiene test watches it)."""
        pool = self._engine.pool
        return pool.checkedout() if isinstance(pool, QueuePool) else 0

    async def wipe(self) -> None:
        """Delete every row (the schema stays, as ``open`` left it): for tests that share one
        PostgreSQL database."""
        tables = [t.name for t in reversed(Base.metadata.sorted_tables)]
        async with _storage_errors(), self._write_engine.begin() as conn:
            if self._dialect == "postgresql":
                await conn.exec_driver_sql(f"TRUNCATE TABLE {', '.join(tables)}")
            else:
                for name in tables:  # children first, for the foreign keys
                    await conn.exec_driver_sql(f"DELETE FROM {name}")

    def _insert_ignore(self, model: type[Base], **values: Any) -> Insert:
        """INSERT that does nothing when the primary key exists, without aborting the txn."""
        if self._dialect == "postgresql":
            return pg_insert(model).values(**values).on_conflict_do_nothing()
        return sqlite_insert(model).values(**values).on_conflict_do_nothing()

    # -- tokens ----------------------------------------------------------------------------

    async def add_enrol_token(
        self, token_hash: str, uses: int | None = None, expires_at: float | None = None
    ) -> str:
        """Store an enrolment token's hash, admitting ``uses`` enrolments (None: unlimited)
        until ``expires_at`` (None: never); returns its id (the hash's first hex digits)."""
        if uses is not None and uses < 1:
            raise ValueError(f"a token admits at least 1 enrolment, got {uses}")
        async with self._writing() as s:
            await s.execute(
                self._insert_ignore(
                    EnrolTokenRow,
                    token_hash=token_hash,
                    created_at=time.time(),
                    uses_left=uses,
                    expires_at=expires_at,
                )
            )
        return token_hash[:TOKEN_ID_HEX]

    async def has_enrol_token(self, token_hash: str) -> bool:
        async with self._reading() as s:
            return await s.get(EnrolTokenRow, token_hash) is not None

    async def enrol_token_state(self, token_hash: str, now: float) -> str:
        """What :func:`token_state` says of the token now (``unknown`` for no such token)."""
        async with self._reading() as s:
            return token_state(await s.get(EnrolTokenRow, token_hash), now)

    async def list_enrol_tokens(self, now: float) -> list[EnrolTokenRecord]:
        async with self._reading() as s:
            rows = await s.scalars(
                select(EnrolTokenRow).order_by(EnrolTokenRow.created_at, EnrolTokenRow.token_hash)
            )
            return [
                EnrolTokenRecord(
                    id=r.token_hash[:TOKEN_ID_HEX],
                    created_at=r.created_at,
                    uses_left=r.uses_left,
                    expires_at=r.expires_at,
                    revoked_at=r.revoked_at,
                    state=token_state(r, now),
                )
                for r in rows
            ]

    async def revoke_enrol_token(self, token_id: str, now: float) -> EnrolTokenRecord:
        """Revoke the one token whose hash starts with ``token_id`` (at least
        ``TOKEN_ID_HEX`` hex digits); revoking twice keeps the first time."""
        token_id = token_id.strip().lower()
        if len(token_id) < TOKEN_ID_HEX or any(c not in "0123456789abcdef" for c in token_id):
            raise NotFoundError(
                f"a token id is at least {TOKEN_ID_HEX} hex digits (see 'token list'), "
                f"got {token_id!r}"
            )
        async with self._writing() as s:
            rows = list(
                await s.scalars(
                    select(EnrolTokenRow)
                    .where(EnrolTokenRow.token_hash.startswith(token_id, autoescape=True))
                    .with_for_update()
                )
            )
            if len(rows) != 1:
                what = "no enrolment token" if not rows else "more than one token"
                raise NotFoundError(f"{what} has the id {token_id!r}")
            row = rows[0]
            if row.revoked_at is None:
                row.revoked_at = now
            return EnrolTokenRecord(
                row.token_hash[:TOKEN_ID_HEX],
                row.created_at,
                row.uses_left,
                row.expires_at,
                row.revoked_at,
                token_state(row, now),
            )

    async def add_operator_token(self, token_hash: str, scope: str = "operator") -> None:
        """Store a token of the operator APIs; ``scope``: ``operator`` or ``read``."""
        if scope not in ("operator", "read"):
            raise ValueError(f"token scope must be operator or read, got {scope!r}")
        async with self._writing() as s:
            await s.execute(
                self._insert_ignore(
                    OperatorTokenRow, token_hash=token_hash, created_at=time.time(), scope=scope
                )
            )

    async def has_operator_token(self, token_hash: str) -> bool:
        """Whether the hash is of a token with the operator's (full) scope."""
        return await self.token_scope(token_hash) == "operator"

    async def token_scope(self, token_hash: str) -> str | None:
        """The scope of an operator-API token (``operator`` or ``read``); None if unknown."""
        async with self._reading() as s:
            row = await s.get(OperatorTokenRow, token_hash)
            return None if row is None else row.scope

    # -- devices ---------------------------------------------------------------------------

    async def add_device(
        self, device: DeviceRecord, enrol_token_hash: str | None = None, now: float = 0.0
    ) -> None:
        """Register a device; a second device with the same id is a :class:`ConflictError`.

        With ``enrol_token_hash``, one use of that token is spent in the same transaction,
        under a lock on its row: two devices racing for the last use cannot both enrol, and
        a refused insert spends nothing. A token that does not admit it (:func:`token_state`
        at ``now``) is an :class:`AuthError` naming why."""
        row = DeviceRow(
            id=device.id,
            credential_hash=device.credential_hash,
            tasks_json=list(device.tasks),
            profile_json=_floats(device.profile),
            enrolled_at=device.enrolled_at,
            last_seen_at=device.last_seen_at,
            device_class=device.device_class,
            public_key=device.public_key,
            revoked_at=device.revoked_at,
            samples_json=_counts(device.samples),
        )
        try:
            async with self._writing() as s:
                if enrol_token_hash is not None:
                    token = await s.get(EnrolTokenRow, enrol_token_hash, with_for_update=True)
                    state = token_state(token, now)
                    if token is None or state != "active":
                        raise AuthError(token_refusal(state))
                    if token.uses_left is not None:
                        token.uses_left -= 1
                s.add(row)
        except IntegrityError as exc:
            raise ConflictError(f"device {device.id!r} is already enrolled") from exc

    async def get_device(self, device_id: str) -> DeviceRecord | None:
        async with self._reading() as s:
            row = await s.get(DeviceRow, device_id)
            return None if row is None else _device_record(row)

    async def list_devices(self) -> list[DeviceRecord]:
        async with self._reading() as s:
            rows = await s.scalars(select(DeviceRow).order_by(DeviceRow.enrolled_at, DeviceRow.id))
            return [_device_record(r) for r in rows]

    async def count_devices(self) -> int:
        async with self._reading() as s:
            return int(await s.scalar(select(func.count()).select_from(DeviceRow)) or 0)

    async def update_device(
        self,
        device_id: str,
        *,
        profile: Mapping[str, float] | None = None,
        last_seen_at: float | None = None,
        tasks: Iterable[str] | None = None,
        device_class: str | None = None,
        samples: Mapping[str, int] | None = None,
    ) -> DeviceRecord:
        """Replace whichever fields are given; ``profile`` and ``samples`` replace the whole
        dict."""
        async with self._writing() as s:
            row = await s.get(DeviceRow, device_id, with_for_update=True)
            if row is None:
                raise NotFoundError(f"unknown device {device_id!r}")
            if profile is not None:
                row.profile_json = _floats(profile)
            if last_seen_at is not None:
                row.last_seen_at = last_seen_at
            if tasks is not None:
                row.tasks_json = list(tasks)
            if device_class is not None:
                row.device_class = device_class
            if samples is not None:
                row.samples_json = _counts(samples)
            return _device_record(row)

    async def revoke_device(self, device_id: str, at: float) -> DeviceRecord:
        """Mark a device revoked at ``at``; revoking it again keeps the first time."""
        async with self._writing() as s:
            row = await s.get(DeviceRow, device_id, with_for_update=True)
            if row is None:
                raise NotFoundError(f"unknown device {device_id!r}")
            if row.revoked_at is None:
                row.revoked_at = at
            return _device_record(row)

    # -- refusals --------------------------------------------------------------------------

    async def add_refusals(self, refusals: Iterable[RefusalRecord]) -> None:
        """Record refused updates, in one transaction (the refusal log writes in batches)."""
        rows = [
            RefusalRow(
                at=r.at,
                device_id=r.device_id[:ID_COLUMN],
                job_id=r.job_id[:ID_COLUMN],
                round=max(min(r.round, 2**31 - 1), -1),
                reason=r.reason[:64],
                detail=r.detail[:MAX_DETAIL],
            )
            for r in refusals
        ]
        if rows:
            async with self._writing() as s:
                s.add_all(rows)

    async def list_refusals(
        self, device_id: str | None = None, job_id: str | None = None, limit: int = 1000
    ) -> list[RefusalRecord]:
        """The newest ``limit`` refusals (of one device or job, if given), newest first."""
        stmt = select(RefusalRow).order_by(RefusalRow.id.desc()).limit(limit)
        if device_id is not None:
            stmt = stmt.where(RefusalRow.device_id == device_id)
        if job_id is not None:
            stmt = stmt.where(RefusalRow.job_id == job_id)
        async with self._reading() as s:
            return [
                RefusalRecord(r.at, r.device_id, r.job_id, r.round, r.reason, r.detail)
                for r in await s.scalars(stmt)
            ]

    # -- jobs ------------------------------------------------------------------------------

    async def add_job(self, job: JobRecord) -> None:
        """Insert a new job; a duplicate id is a :class:`ConflictError`."""
        check_job_state(job.state)
        row = JobRow(
            id=job.id,
            name=job.name,
            spec_json=job.spec_json,
            state=job.state,
            rounds_total=job.rounds_total,
            rounds_committed=job.rounds_committed,
            checkpoint_sha256=job.checkpoint_sha256,
            created_at=job.created_at,
            updated_at=job.updated_at,
            metrics_json=_floats(job.metrics),
        )
        try:
            async with self._writing() as s:
                s.add(row)
        except IntegrityError as exc:
            raise ConflictError(f"job {job.id!r} already exists") from exc

    async def get_job(self, job_id: str) -> JobRecord | None:
        async with self._reading() as s:
            row = await s.get(JobRow, job_id)
            return None if row is None else _job_record(row)

    async def list_jobs(self) -> list[JobRecord]:
        """All jobs, oldest first."""
        async with self._reading() as s:
            rows = await s.scalars(select(JobRow).order_by(JobRow.created_at, JobRow.id))
            return [_job_record(r) for r in rows]

    async def jobs_to_resume(self) -> list[JobRecord]:
        """Jobs a restarted server must pick up again (pending or running), oldest first."""
        async with self._reading() as s:
            rows = await s.scalars(
                select(JobRow)
                .where(JobRow.state.in_(RESUMABLE_STATES))
                .order_by(JobRow.created_at, JobRow.id)
            )
            return [_job_record(r) for r in rows]

    async def set_job_state(self, job_id: str, state: str) -> JobRecord:
        """Move a job to ``state``; a finished job stays finished (:class:`JobStateError`)."""
        check_job_state(state)
        async with self._writing() as s:
            row = await s.get(JobRow, job_id, with_for_update=True)
            if row is None:
                raise NotFoundError(f"unknown job {job_id!r}")
            if row.state != state:
                check_transition(job_id, row.state, state)
                row.state = state
                row.updated_at = time.time()
            return _job_record(row)

    # -- checkpoints -----------------------------------------------------------------------

    async def add_checkpoint(self, sha256: str, size_bytes: int) -> None:
        """Record a checkpoint blob; repeating it is harmless and fills in an unknown size."""
        async with self._writing() as s:
            await s.execute(
                self._insert_ignore(
                    CheckpointRow, sha256=sha256, size_bytes=size_bytes, created_at=time.time()
                )
            )
            if size_bytes > 0:
                # A commit that did not know a blob's size registered it with 0 ("unknown").
                await s.execute(
                    update(CheckpointRow)
                    .where(CheckpointRow.sha256 == sha256, CheckpointRow.size_bytes == 0)
                    .values(size_bytes=size_bytes)
                )

    async def get_checkpoint_size(self, sha256: str) -> int | None:
        """Size in bytes of a known checkpoint (0 if unknown), or None if never recorded."""
        async with self._reading() as s:
            row = await s.get(CheckpointRow, sha256)
            return None if row is None else row.size_bytes

    # -- servers and job leases ------------------------------------------------------------

    async def announce(self, presence: ServerPresence) -> None:
        """Record (or refresh) a live server process of the deployment."""
        wanted = json.dumps(dict(presence.wanted), sort_keys=True)
        async with self._writing() as s:
            row = await s.get(ServerRow, presence.holder, with_for_update=True)
            if row is None:
                s.add(ServerRow(holder=presence.holder, expires_at=presence.expires_at,
                                wanted_json=wanted))  # fmt: skip
            else:
                row.expires_at, row.wanted_json = presence.expires_at, wanted

    async def servers(self, now: float) -> list[ServerPresence]:
        """The server processes alive at ``now``, by holder."""
        async with self._reading() as s:
            rows = await s.scalars(
                select(ServerRow).where(ServerRow.expires_at > now).order_by(ServerRow.holder)
            )
            return [_presence(r) for r in rows]

    async def withdraw(self, holder: str) -> None:
        """A clean stop: the server leaves the deployment and its job leases end now, so
        the others need not wait them out."""
        async with self._writing() as s:
            row = await s.get(ServerRow, holder)
            if row is not None:
                await s.delete(row)
            await s.execute(
                update(JobLeaseRow).where(JobLeaseRow.holder == holder).values(expires_at=0.0)
            )

    async def job_leases(self, job_ids: Iterable[str] | None = None) -> list[JobLease]:
        """The leases of ``job_ids`` (default: every job) ever taken, expired ones too."""
        query = select(JobLeaseRow).order_by(JobLeaseRow.job_id)
        if job_ids is not None:
            query = query.where(JobLeaseRow.job_id.in_(list(job_ids)))
        async with self._reading() as s:
            return [_job_lease(r) for r in await s.scalars(query)]

    async def take_job(
        self, job_id: str, holder: str, lease_s: float, now: float, replacing: str = ""
    ) -> JobLease | None:
        """Take or renew ``job_id``'s lease for ``holder`` until ``now + lease_s``: when no
        one holds it, ``holder`` already does, it expired, or ``replacing`` names the
        current holder (known dead). The lease as it now stands if ``holder`` holds it,
        else None. A new holder gets the next epoch."""
        async with self._writing() as s:
            row = await s.get(JobLeaseRow, job_id, with_for_update=True)
            if row is None:
                row = JobLeaseRow(job_id=job_id, holder=holder, epoch=1, expires_at=now + lease_s)
                s.add(row)
                return _job_lease(row)
            ours = row.holder == holder
            if not ours and row.expires_at > now and (not replacing or row.holder != replacing):
                return None
            if not ours:
                row.holder, row.epoch = holder, row.epoch + 1
            row.expires_at = now + lease_s
            return _job_lease(row)

    async def renew_jobs(self, holder: str, lease_s: float, now: float) -> list[JobLease]:
        """Extend every unexpired lease ``holder`` holds to ``now + lease_s``; those leases.
        One that expired stays expired (another server may have read it so): ``holder``
        must take it again, and may lose it."""
        async with self._writing() as s:
            rows = list(
                await s.scalars(
                    select(JobLeaseRow)
                    .where(JobLeaseRow.holder == holder, JobLeaseRow.expires_at > now)
                    .order_by(JobLeaseRow.job_id)
                    .with_for_update()
                )
            )
            for row in rows:
                row.expires_at = now + lease_s
            return [_job_lease(r) for r in rows]

    async def release_job(self, job_id: str, holder: str) -> None:
        """End ``holder``'s lease of ``job_id`` now, so another server takes the job."""
        async with self._writing() as s:
            await s.execute(
                update(JobLeaseRow)
                .where(JobLeaseRow.job_id == job_id, JobLeaseRow.holder == holder)
                .values(expires_at=0.0)
            )

    @staticmethod
    async def _check_fence(s: AsyncSession, job_id: str, fence: LeaseFence, now: float) -> None:
        row = await s.get(JobLeaseRow, job_id, with_for_update=True)
        if row is None or (row.holder, row.epoch) != (fence.holder, fence.epoch):
            raise LeaseLost(f"another server took job {job_id} over: not committing")
        if row.expires_at < now:
            raise LeaseLost(f"this server's lease of job {job_id} expired: not committing")
        row.expires_at = now + fence.lease_s

    # -- rounds ----------------------------------------------------------------------------

    async def commit_round(self, c: RoundCommit, fence: LeaseFence | None = None) -> JobRecord:
        """Store a finished round and advance its job, all in one transaction.

        Raises :class:`RoundConflict` (and writes nothing) unless ``c.round`` is exactly the
        job's next round and the job is not finished; the job is ``completed`` after its last
        round and ``running`` otherwise. With a ``fence``, :class:`LeaseLost` (nothing
        written) unless its holder still holds the job's lease at its epoch, unexpired; the
        lease is then extended in the same transaction.
        """
        check_commit(c)
        where = f"round {c.round} of job {c.job_id!r}"
        try:
            async with self._writing() as s:
                if fence is not None:
                    await self._check_fence(s, c.job_id, fence, c.committed_at)
                # The row lock makes concurrent commits of one job queue up here; the loser
                # then sees the winner's rounds_committed and is refused below.
                job = await s.get(JobRow, c.job_id, with_for_update=True)
                if job is None:
                    raise NotFoundError(f"unknown job {c.job_id!r}")
                check_next_round(c, job.state, job.rounds_committed, job.rounds_total)
                if await s.get(RoundRow, (c.job_id, c.round)) is not None:
                    raise RoundConflict(f"{where} refused: it is already committed")
                await s.execute(
                    self._insert_ignore(
                        CheckpointRow,
                        sha256=c.checkpoint_sha256,
                        size_bytes=c.checkpoint_size,
                        created_at=c.committed_at,
                    )
                )
                await s.execute(
                    insert(RoundRow).values(
                        job_id=c.job_id,
                        round=c.round,
                        checkpoint_sha256=c.checkpoint_sha256,
                        metrics_json=_floats(c.metrics),
                        started_at=c.started_at,
                        committed_at=c.committed_at,
                        account_json=c.account.to_json(),
                    )
                )
                if c.participants:
                    await s.execute(
                        insert(ParticipationRow),
                        [
                            {
                                "job_id": p.job_id,
                                "round": p.round,
                                "device_id": p.device_id,
                                "num_samples": p.num_samples,
                                "started_at": p.started_at,
                                "finished_at": p.finished_at,
                                "metrics_json": _floats(p.metrics),
                            }
                            for p in c.participants
                        ],
                    )
                job.rounds_committed = c.round
                job.checkpoint_sha256 = c.checkpoint_sha256
                job.aggregator_sha256 = c.aggregator_sha256
                job.scheduler_sha256 = c.scheduler_sha256
                job.metrics_json = _floats(c.metrics)
                job.updated_at = c.committed_at
                job.state = state_after(c, job.rounds_total)
                await s.flush()
                return _job_record(job)
        except IntegrityError as exc:
            # A duplicate round or participant that slipped past the checks above.
            raise RoundConflict(f"{where} refused by the database: {exc.orig}") from exc

    async def list_rounds(self, job_id: str, after: int = 0) -> list[RoundRecord]:
        """Committed rounds of a job in order, each with its participants; with ``after``,
        only those numbered above it (what a reader that has the rest fetches)."""
        async with self._reading() as s:
            rounds = (
                await s.scalars(
                    select(RoundRow)
                    .where(RoundRow.job_id == job_id, RoundRow.round > after)
                    .order_by(RoundRow.round)
                )
            ).all()
            parts = await s.scalars(
                select(ParticipationRow)
                .where(ParticipationRow.job_id == job_id, ParticipationRow.round > after)
                .order_by(ParticipationRow.round, ParticipationRow.device_id)
            )
            by_round: dict[int, list[ParticipationRecord]] = {}
            for p in parts:
                by_round.setdefault(p.round, []).append(_participation_record(p))
            return [
                RoundRecord(
                    job_id=r.job_id,
                    round=r.round,
                    checkpoint_sha256=r.checkpoint_sha256,
                    metrics=dict(r.metrics_json),
                    started_at=r.started_at,
                    committed_at=r.committed_at,
                    participants=tuple(by_round.get(r.round, ())),
                    account=RoundAccount.from_json(r.account_json),
                )
                for r in rounds
            ]

    async def list_participations(self, job_id: str | None = None) -> list[ParticipationRecord]:
        """Participations of one job, or of all jobs, ordered by job, round and device."""
        stmt = select(ParticipationRow).order_by(
            ParticipationRow.job_id, ParticipationRow.round, ParticipationRow.device_id
        )
        if job_id is not None:
            stmt = stmt.where(ParticipationRow.job_id == job_id)
        async with self._reading() as s:
            return [_participation_record(p) for p in await s.scalars(stmt)]
