"""A database made by the previous release opens with this one, rows intact, and takes writes.

The previous release created its tables from the ORM without migrations and kept JSON in
Text columns; ``tests/support/previous_schema.py`` holds that DDL as it was. Run on SQLite always
and on PostgreSQL when FLOTILLA_TEST_POSTGRES_URL is set.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from flotilla.core.records import (
    DeviceFailure,
    DeviceRecord,
    ParticipationRecord,
    RoundAccount,
    RoundCommit,
)
from flotilla.server.federation.migrations import HEAD
from flotilla.server.federation.store import Store, async_url
from tests.support.previous_schema import DDL

pytestmark = pytest.mark.timeout(120)

TABLES = (
    "refusals",
    "participations",
    "rounds",
    "jobs",
    "operator_tokens",
    "enrol_tokens",
    "devices",
    "checkpoints",
    "alembic_version",
)


def sha(n: int) -> str:
    return f"{n:064x}"


def _dumps(value: object) -> str:
    """JSON as the previous release wrote it into its Text columns."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


ROWS = (
    ("checkpoints", {"sha256": sha(0), "size_bytes": 100, "created_at": 1.0}),
    ("checkpoints", {"sha256": sha(1), "size_bytes": 100, "created_at": 2.0}),
    ("enrol_tokens", {"token_hash": "enrol-hash", "created_at": 1.0}),
    ("operator_tokens", {"token_hash": "operator-hash", "created_at": 1.0}),
    (
        "devices",
        {
            "id": "dev-a",
            "credential_hash": "cred-a",
            "tasks_json": _dumps(["digits", "charlm"]),
            "profile_json": _dumps({"gflops": 12.5, "memory_bytes": 8e9}),
            "enrolled_at": 5.0,
            "last_seen_at": 6.0,
        },
    ),
    (
        "devices",  # empty text: the previous release read it as no tasks and no profile
        {
            "id": "dev-b",
            "credential_hash": "cred-b",
            "tasks_json": "",
            "profile_json": "",
            "enrolled_at": 7.0,
            "last_seen_at": 8.0,
        },
    ),
    (
        "jobs",
        {
            "id": "job-1",
            "name": "digits",
            "spec_json": '{"job": {"rounds": 3}}',
            "state": "running",
            "rounds_total": 3,
            "rounds_committed": 1,
            "checkpoint_sha256": sha(1),
            "aggregator_sha256": sha(11),
            "scheduler_sha256": sha(21),
            "created_at": 10.0,
            "updated_at": 20.0,
            "metrics_json": _dumps({"accuracy": 0.5, "loss": 1.25}),
        },
    ),
    (
        "rounds",
        {
            "job_id": "job-1",
            "round": 1,
            "checkpoint_sha256": sha(1),
            "metrics_json": _dumps({"accuracy": 0.5, "loss": 1.25}),
            "started_at": 11.0,
            "committed_at": 20.0,
        },
    ),
    (
        "participations",
        {
            "job_id": "job-1",
            "round": 1,
            "device_id": "dev-a",
            "num_samples": 64,
            "started_at": 11.0,
            "finished_at": 15.0,
            "metrics_json": _dumps({"bytes_up": 4096.0, "loss": 1.5}),
        },
    ),
)


def _engine(url: str) -> AsyncEngine:
    target = async_url(url)
    if target.get_backend_name() == "sqlite" and target.database:
        Path(target.database).parent.mkdir(parents=True, exist_ok=True)
    return create_async_engine(target)


async def _previous_release_database(url: str) -> None:
    """Empty the database, then lay it out and fill it as the previous release did."""
    engine = _engine(url)
    try:
        async with engine.begin() as conn:
            dialect = conn.dialect.name
            for table in TABLES:
                cascade = " CASCADE" if dialect == "postgresql" else ""
                await conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}{cascade}")
            for statement in DDL[dialect]:
                await conn.exec_driver_sql(statement)
            for table, row in ROWS:
                names = ", ".join(row)
                values = ", ".join(f":{k}" for k in row)
                await conn.execute(text(f"INSERT INTO {table} ({names}) VALUES ({values})"), row)
    finally:
        await engine.dispose()


async def _schema_version_and_json_types(url: str) -> tuple[str, dict[str, str]]:
    engine = _engine(url)
    try:
        async with engine.connect() as conn:
            version = (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalar()

            def types(sync_conn: object) -> dict[str, str]:
                inspector = inspect(sync_conn)
                return {
                    f"{t}.{c['name']}": str(c["type"])
                    for t in ("devices", "jobs", "rounds", "participations")
                    for c in inspector.get_columns(t)
                    if c["name"].endswith("_json") and c["name"] != "spec_json"
                }

            return str(version), await conn.run_sync(types)
    finally:
        await engine.dispose()


async def test_a_previous_release_database_is_upgraded_and_keeps_its_rows(db_url: str) -> None:
    await _previous_release_database(db_url)
    store = await Store.open(db_url)
    try:
        job = await store.get_job("job-1")
        assert job is not None
        assert (job.name, job.state, job.rounds_total, job.rounds_committed) == (
            "digits",
            "running",
            3,
            1,
        )
        assert (job.checkpoint_sha256, job.aggregator_sha256, job.scheduler_sha256) == (
            sha(1),
            sha(11),
            sha(21),
        )
        assert job.metrics == {"accuracy": 0.5, "loss": 1.25}
        assert job.spec_json == '{"job": {"rounds": 3}}'
        [rnd] = await store.list_rounds("job-1")
        assert (rnd.round, rnd.checkpoint_sha256, rnd.started_at, rnd.committed_at) == (
            1,
            sha(1),
            11.0,
            20.0,
        )
        assert rnd.metrics == {"accuracy": 0.5, "loss": 1.25}
        assert rnd.account == RoundAccount()  # committed before rounds kept an account
        assert rnd.participants == (
            ParticipationRecord(
                "job-1", 1, "dev-a", 64, 11.0, 15.0, {"bytes_up": 4096, "loss": 1.5}
            ),
        )
        assert await store.list_devices() == [
            DeviceRecord(
                "dev-a",
                "cred-a",
                ("digits", "charlm"),
                {"gflops": 12.5, "memory_bytes": 8e9},
                5.0,
                6.0,
            ),
            DeviceRecord("dev-b", "cred-b", (), {}, 7.0, 8.0),
        ]
        assert await store.has_enrol_token("enrol-hash")
        assert await store.has_operator_token("operator-hash")
        assert await store.get_checkpoint_size(sha(0)) == 100

        # New writes land in the upgraded tables and read back.
        part = ParticipationRecord("job-1", 2, "dev-b", 32, 21.0, 25.0, {"loss": 0.75})
        account = RoundAccount(("dev-a", "dev-b"), (DeviceFailure("dev-a", "left"),))
        after = await store.commit_round(
            RoundCommit(
                "job-1", 2, sha(2), {"accuracy": 0.75}, 21.0, 30.0, (part,), account=account
            )
        )
        assert (after.rounds_committed, after.metrics) == (2, {"accuracy": 0.75})
        rounds = await store.list_rounds("job-1")
        assert [r.round for r in rounds] == [1, 2]
        assert [r.account for r in rounds] == [RoundAccount(), account]
        assert (await store.list_participations("job-1"))[-1] == part
        updated = await store.update_device("dev-b", profile={"gflops": 3.0}, tasks=["digits"])
        assert (updated.tasks, updated.profile) == (("digits",), {"gflops": 3.0})
        await store.add_device(DeviceRecord("dev-c", "cred-c", ("x",), {"gflops": 1.0}, 9.0, 9.0))
        assert await store.get_device("dev-c") is not None
    finally:
        await store.close()

    version, types = await _schema_version_and_json_types(db_url)
    assert version == HEAD
    if db_url.startswith("postgresql"):
        assert set(types.values()) == {"JSON"}, types
    reopened = await Store.open(db_url)  # an upgraded database opens again as it is
    try:
        assert [r.round for r in await reopened.list_rounds("job-1")] == [1, 2]
    finally:
        await reopened.close()


async def test_a_fresh_database_is_created_at_the_newest_revision(db_url: str) -> None:
    engine = _engine(db_url)
    try:
        async with engine.begin() as conn:
            cascade = " CASCADE" if conn.dialect.name == "postgresql" else ""
            for table in TABLES:
                await conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}{cascade}")
    finally:
        await engine.dispose()
    store = await Store.open(db_url)
    await store.close()
    version, _ = await _schema_version_and_json_types(db_url)
    assert version == HEAD
