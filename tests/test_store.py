"""Contract tests for the server's Store, run on SQLite always and on PostgreSQL when asked.

Set ``FLOTILLA_TEST_POSTGRES_URL`` (e.g. ``postgresql://root@127.0.0.1:5432/test``) to add
the PostgreSQL backend; its tables are wiped at the start of every test (the ``store`` and
``db_url`` fixtures live in conftest.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from flotilla.core.errors import FlotillaError, NotFoundError
from flotilla.core.records import (
    JOB_STATES,
    TERMINAL_STATES,
    DeviceRecord,
    JobRecord,
    ParticipationRecord,
    RoundCommit,
)
from flotilla.server.federation.store import (
    ConflictError,
    JobStateError,
    RoundConflict,
    Store,
    async_url,
    default_url,
)


def sha(n: int) -> str:
    return f"{n:064x}"


def make_job(job_id: str = "job-1", rounds_total: int = 3, created_at: float = 1000.0) -> JobRecord:
    return JobRecord(
        id=job_id,
        name=f"name of {job_id}",
        spec_json='{"task": "mnist"}',
        state="pending",
        rounds_total=rounds_total,
        rounds_committed=0,
        checkpoint_sha256=sha(0),
        created_at=created_at,
        updated_at=created_at,
        metrics={},
    )


def make_commit(
    job_id: str = "job-1",
    rnd: int = 1,
    devices: tuple[str, ...] = ("dev-a", "dev-b"),
    checkpoint: str | None = None,
) -> RoundCommit:
    t0 = 2000.0 + 10 * rnd
    return RoundCommit(
        job_id=job_id,
        round=rnd,
        checkpoint_sha256=checkpoint or sha(rnd),
        metrics={"loss": 1.0 / rnd, "accuracy": 0.5 + rnd / 100},
        started_at=t0,
        committed_at=t0 + 5.25,
        participants=tuple(
            ParticipationRecord(
                job_id=job_id,
                round=rnd,
                device_id=d,
                num_samples=100 + i,
                started_at=t0 + 0.5,
                finished_at=t0 + 4.125,
                metrics={"loss": 0.25 * (i + 1)},
            )
            for i, d in enumerate(devices)
        ),
    )


# -- urls ------------------------------------------------------------------------------------


def test_urls_map_to_async_drivers(tmp_path: Path) -> None:
    assert default_url(tmp_path) == f"sqlite+aiosqlite:///{tmp_path}/flotilla.db"
    assert Store.default_url(tmp_path) == default_url(tmp_path)
    assert async_url("sqlite:///x/y.db").drivername == "sqlite+aiosqlite"
    assert async_url("sqlite+aiosqlite:///x/y.db").drivername == "sqlite+aiosqlite"
    assert async_url("postgresql://u@h:5432/d").drivername == "postgresql+asyncpg"
    assert async_url("postgres://u@h/d").drivername == "postgresql+asyncpg"
    with pytest.raises(ValueError, match="not async"):
        async_url("postgresql+psycopg2://u@h/d")
    with pytest.raises(ValueError, match="unsupported"):
        async_url("mysql://u@h/d")


async def test_default_url_opens(tmp_path: Path) -> None:
    s = await Store.open(default_url(tmp_path / "fresh"))
    try:
        assert s.dialect == "sqlite"
        assert (tmp_path / "fresh" / "flotilla.db").exists()
    finally:
        await s.close()


# -- tokens ----------------------------------------------------------------------------------


async def test_tokens(store: Store) -> None:
    assert not await store.has_enrol_token("e1")
    await store.add_enrol_token("e1")
    await store.add_enrol_token("e1")  # idempotent
    assert await store.has_enrol_token("e1")
    assert not await store.has_operator_token("e1")  # separate tables

    await store.add_operator_token("o1")
    await store.add_operator_token("o1")
    assert await store.has_operator_token("o1")
    assert not await store.has_enrol_token("o1")


# -- devices ---------------------------------------------------------------------------------


async def test_device_add_get_update(store: Store) -> None:
    dev = DeviceRecord(
        id="dev-a",
        credential_hash="h" * 64,
        tasks=("mnist", "cifar10"),
        profile={"gflops": 12.5, "memory_bytes": 4.0 * 2**30, "upload_bytes_per_s": 1e6},
        enrolled_at=1234.5,
        last_seen_at=1234.5,
    )
    assert await store.get_device("dev-a") is None
    await store.add_device(dev)
    assert await store.get_device("dev-a") == dev
    with pytest.raises(ConflictError):
        await store.add_device(dev)

    updated = await store.update_device("dev-a", last_seen_at=1300.75)
    assert updated == DeviceRecord(
        id="dev-a",
        credential_hash=dev.credential_hash,
        tasks=dev.tasks,
        profile=dev.profile,
        enrolled_at=1234.5,
        last_seen_at=1300.75,
    )
    updated = await store.update_device("dev-a", profile={"gflops": 3.0}, tasks=["mnist"])
    assert updated.profile == {"gflops": 3.0}
    assert updated.tasks == ("mnist",)
    assert updated.last_seen_at == 1300.75
    assert await store.get_device("dev-a") == updated

    other = DeviceRecord("dev-b", "x", (), {}, 1500.0, 1500.0)
    await store.add_device(other)
    assert [d.id for d in await store.list_devices()] == ["dev-a", "dev-b"]

    with pytest.raises(NotFoundError, match="unknown device 'nope'"):
        await store.update_device("nope", last_seen_at=1.0)


# -- jobs ------------------------------------------------------------------------------------


async def test_job_lifecycle(store: Store) -> None:
    assert set(TERMINAL_STATES) < set(JOB_STATES)
    await store.add_job(make_job("job-2", created_at=2000.0))
    await store.add_job(make_job("job-1", created_at=1000.0))
    await store.add_job(make_job("job-3", created_at=3000.0))
    with pytest.raises(ConflictError):
        await store.add_job(make_job("job-1"))
    with pytest.raises(ValueError, match="unknown job state"):
        await store.add_job(JobRecord("job-x", "n", "{}", "bogus", 1, 0, "", 1.0, 1.0, {}))

    assert await store.get_job("job-1") == make_job("job-1", created_at=1000.0)
    assert await store.get_job("missing") is None
    assert [j.id for j in await store.list_jobs()] == ["job-1", "job-2", "job-3"]

    running = await store.set_job_state("job-1", "running")
    assert running.state == "running"
    assert running.updated_at > 1000.0
    failed = await store.set_job_state("job-2", "failed")
    assert failed.state == "failed"
    assert [j.id for j in await store.jobs_to_resume()] == ["job-1", "job-3"]

    # Terminal states are final; restating one is a harmless no-op.
    assert (await store.set_job_state("job-2", "failed")).state == "failed"
    for state in ("running", "pending", "completed"):
        with pytest.raises(JobStateError, match="failed"):
            await store.set_job_state("job-2", state)
    assert (await store.get_job("job-2")) == failed
    assert isinstance(JobStateError("x"), FlotillaError)
    assert isinstance(JobStateError("x"), ValueError)

    with pytest.raises(ValueError, match="unknown job state"):
        await store.set_job_state("job-1", "paused")
    with pytest.raises(NotFoundError, match="unknown job 'nope'"):
        await store.set_job_state("nope", "running")


# -- rounds ----------------------------------------------------------------------------------


async def test_commit_round_happy_path(store: Store) -> None:
    await store.add_job(make_job(rounds_total=2))
    await store.add_checkpoint(sha(1), 4096)

    job = await store.commit_round(make_commit(rnd=1))
    assert job.state == "running"
    assert job.rounds_committed == 1
    assert job.checkpoint_sha256 == sha(1)
    assert job.metrics == {"loss": 1.0, "accuracy": 0.51}
    assert job.updated_at == 2015.25
    assert await store.get_job("job-1") == job
    assert await store.get_checkpoint_size(sha(1)) == 4096

    job = await store.commit_round(make_commit(rnd=2, devices=("dev-c",)))
    assert job.state == "completed"
    assert job.rounds_committed == 2
    assert job.metrics == {"loss": 0.5, "accuracy": 0.52}
    assert await store.jobs_to_resume() == []
    # commit_round registered the unseen checkpoint; add_checkpoint fills in its size later.
    assert await store.get_checkpoint_size(sha(2)) == 0
    await store.add_checkpoint(sha(2), 777)
    await store.add_checkpoint(sha(2), 777)
    assert await store.get_checkpoint_size(sha(2)) == 777

    rounds = await store.list_rounds("job-1")
    assert [r.round for r in rounds] == [1, 2]
    first = make_commit(rnd=1)
    assert rounds[0].checkpoint_sha256 == first.checkpoint_sha256
    assert rounds[0].metrics == first.metrics
    assert (rounds[0].started_at, rounds[0].committed_at) == (first.started_at, 2015.25)
    assert rounds[0].participants == first.participants
    assert rounds[1].participants == make_commit(rnd=2, devices=("dev-c",)).participants

    parts = await store.list_participations("job-1")
    assert [(p.round, p.device_id) for p in parts] == [(1, "dev-a"), (1, "dev-b"), (2, "dev-c")]
    assert await store.list_participations() == parts
    assert await store.list_participations("other") == []
    assert await store.list_rounds("other") == []

    # The job is completed: no further rounds.
    with pytest.raises(RoundConflict, match="completed"):
        await store.commit_round(make_commit(rnd=3))


async def test_commit_same_round_twice_refused(store: Store) -> None:
    await store.add_job(make_job())
    await store.commit_round(make_commit(rnd=1))
    before = await store.get_job("job-1")
    with pytest.raises(RoundConflict):
        await store.commit_round(make_commit(rnd=1, checkpoint=sha(99)))
    assert len(await store.list_rounds("job-1")) == 1
    assert len(await store.list_participations("job-1")) == 2
    assert await store.get_job("job-1") == before
    assert await store.get_checkpoint_size(sha(99)) is None


async def test_out_of_order_round_refused(store: Store) -> None:
    await store.add_job(make_job())
    with pytest.raises(RoundConflict, match="next is 1"):
        await store.commit_round(make_commit(rnd=2))
    await store.commit_round(make_commit(rnd=1))
    with pytest.raises(RoundConflict, match="next is 2"):
        await store.commit_round(make_commit(rnd=3))
    assert [r.round for r in await store.list_rounds("job-1")] == [1]
    with pytest.raises(NotFoundError, match="unknown job 'nope'"):
        await store.commit_round(make_commit(job_id="nope"))
    with pytest.raises(ValueError, match="not job"):
        await store.commit_round(
            RoundCommit("job-1", 2, sha(2), {}, 1.0, 2.0, make_commit(rnd=1).participants)
        )


async def test_commit_to_cancelled_job_refused(store: Store) -> None:
    await store.add_job(make_job())
    await store.set_job_state("job-1", "cancelled")
    with pytest.raises(RoundConflict, match="cancelled"):
        await store.commit_round(make_commit(rnd=1))
    assert await store.list_rounds("job-1") == []


async def test_failed_participation_insert_rolls_back_everything(store: Store) -> None:
    await store.add_job(make_job())
    await store.commit_round(make_commit(rnd=1))
    before = await store.get_job("job-1")

    # The duplicate participant fails in the database after the checkpoint and round rows
    # were already inserted in the same transaction.
    bad = make_commit(rnd=2, devices=("dev-a", "dev-b", "dev-a"), checkpoint=sha(42))
    with pytest.raises(RoundConflict, match="refused by the database"):
        await store.commit_round(bad)

    assert await store.get_job("job-1") == before
    assert [r.round for r in await store.list_rounds("job-1")] == [1]
    assert [p.round for p in await store.list_participations("job-1")] == [1, 1]
    assert await store.get_checkpoint_size(sha(42)) is None

    # The store is still usable and the same round commits cleanly once fixed.
    job = await store.commit_round(make_commit(rnd=2, checkpoint=sha(42)))
    assert job.rounds_committed == 2


async def test_concurrent_commits_of_one_round(store: Store) -> None:
    await store.add_job(make_job(rounds_total=5))
    commits = [make_commit(rnd=1, checkpoint=sha(100 + i)) for i in range(6)]
    results = await asyncio.gather(
        *(store.commit_round(c) for c in commits), return_exceptions=True
    )
    winners = [r for r in results if isinstance(r, JobRecord)]
    losers = [r for r in results if not isinstance(r, JobRecord)]
    assert len(winners) == 1, results
    assert all(isinstance(r, RoundConflict) for r in losers), results
    # Losers queued behind the winner's lock and were refused by the ordering check, not by
    # a constraint violation mid-transaction.
    assert all("next is 2" in str(r) for r in losers), results
    rounds = await store.list_rounds("job-1")
    assert len(rounds) == 1
    assert rounds[0].checkpoint_sha256 == winners[0].checkpoint_sha256
    assert (await store.get_job("job-1")) == winners[0]


async def test_concurrent_commits_from_two_servers(store: Store, db_url: str) -> None:
    """Two engines on one database (two server processes): the lock still admits one."""
    await store.add_job(make_job(rounds_total=5))
    other = await Store.open(db_url)
    try:
        for rnd in (1, 2, 3):
            results = await asyncio.gather(
                store.commit_round(make_commit(rnd=rnd, checkpoint=sha(rnd))),
                other.commit_round(make_commit(rnd=rnd, checkpoint=sha(50 + rnd))),
                return_exceptions=True,
            )
            assert sum(isinstance(r, JobRecord) for r in results) == 1, results
            assert sum(isinstance(r, RoundConflict) for r in results) == 1, results
            assert any(f"next is {rnd + 1}" in str(r) for r in results), results
    finally:
        await other.close()
    assert [r.round for r in await store.list_rounds("job-1")] == [1, 2, 3]
    job = await store.get_job("job-1")
    assert job is not None
    assert job.rounds_committed == 3


async def test_data_survives_reopen(store: Store, db_url: str) -> None:
    dev = DeviceRecord("dev-a", "cred", ("mnist",), {"gflops": 1.5}, 10.0, 11.0)
    await store.add_device(dev)
    await store.add_enrol_token("e1")
    await store.add_operator_token("o1")
    await store.add_job(make_job(rounds_total=3))
    await store.commit_round(make_commit(rnd=1))
    job = await store.get_job("job-1")
    rounds = await store.list_rounds("job-1")
    await store.close()

    reopened = await Store.open(db_url)
    try:
        assert await reopened.get_device("dev-a") == dev
        assert await reopened.has_enrol_token("e1")
        assert await reopened.has_operator_token("o1")
        assert await reopened.get_job("job-1") == job
        assert await reopened.list_rounds("job-1") == rounds
        assert [j.id for j in await reopened.jobs_to_resume()] == ["job-1"]
        # And it carries on where it left off.
        assert (await reopened.commit_round(make_commit(rnd=2))).rounds_committed == 2
    finally:
        await reopened.close()


async def test_a_database_from_before_a_new_column_is_upgraded_in_place(
    store: Store, db_url: str
) -> None:
    await store.add_job(make_job("job-old"))
    async with store._write_engine.begin() as conn:  # as an earlier release left it
        await conn.exec_driver_sql("ALTER TABLE jobs DROP COLUMN scheduler_sha256")
        await conn.exec_driver_sql("DROP TABLE alembic_version")  # (before migrations)
    await store.close()
    reopened = await Store.open(db_url)
    try:
        job = await reopened.get_job("job-old")
        assert job is not None and job.scheduler_sha256 == ""
        await reopened.commit_round(
            RoundCommit("job-old", 1, sha(1), {}, 1.0, 2.0, (), scheduler_sha256=sha(2))
        )
        job = await reopened.get_job("job-old")
        assert job is not None and job.scheduler_sha256 == sha(2)
    finally:
        await reopened.close()
