"""One contract for every ledger the engine commits rounds to.

The SQL :class:`Store` (SQLite always, PostgreSQL when FLOTILLA_TEST_POSTGRES_URL is set)
and the simulation's :class:`SimLedger` must agree on what a commit may do: only the job's
next round commits, each round exactly once, nothing commits to a finished job, and a
finished job never changes state. A refused call writes nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from flotilla.core.errors import JobStateError, NotFoundError, RoundConflict
from flotilla.core.records import (
    JOB_STATES,
    TERMINAL_STATES,
    JobRecord,
    ParticipationRecord,
    RoundCommit,
)
from flotilla.engine.ports import Ledger
from flotilla.simulation.runner import SimLedger
from tests.support.databases import database_params, database_url, open_empty_store

pytestmark = pytest.mark.timeout(60)

ROUNDS = 3


@dataclass(frozen=True)
class Subject:
    """A ledger plus what the contract needs to set it up and read it back."""

    ledger: Ledger
    add_job: Callable[[JobRecord], Awaitable[None]]
    get_job: Callable[[str], Awaitable[JobRecord | None]]
    #: The round numbers committed for a job, in order.
    rounds: Callable[[str], Awaitable[list[int]]]


class Committed:
    """A SimLedger observer that remembers what was committed."""

    def __init__(self) -> None:
        self.rounds: dict[str, list[int]] = {}

    def committed(self, job: JobRecord, commit: RoundCommit) -> None:
        self.rounds.setdefault(job.id, []).append(commit.round)


@pytest.fixture(params=[*database_params(), pytest.param("simulation", id="simulation")])
async def subject(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Subject]:
    if request.param == "simulation":
        seen = Committed()
        sim = SimLedger([seen])

        async def add(job: JobRecord) -> None:
            sim.add(job)

        async def get(job_id: str) -> JobRecord | None:
            return sim.jobs.get(job_id)

        async def sim_rounds(job_id: str) -> list[int]:
            return list(seen.rounds.get(job_id, []))

        yield Subject(sim, add, get, sim_rounds)
        return
    store = await open_empty_store(database_url(request.param, tmp_path))

    async def store_rounds(job_id: str) -> list[int]:
        return [r.round for r in await store.list_rounds(job_id)]

    try:
        yield Subject(store, store.add_job, store.get_job, store_rounds)
    finally:
        await store.close()


def sha(n: int) -> str:
    return f"{n:064x}"


def job(job_id: str = "job-1", rounds: int = ROUNDS) -> JobRecord:
    return JobRecord.submitted(job_id, f"name of {job_id}", '{"task": "t"}', rounds, sha(0), 10.0)


def commit(rnd: int, job_id: str = "job-1", devices: tuple[str, ...] = ("d1", "d2")) -> RoundCommit:
    parts = tuple(
        ParticipationRecord(job_id, rnd, d, 10 + i, 10.0 * rnd, 10.0 * rnd + 1, {"loss": 0.5})
        for i, d in enumerate(devices)
    )
    return RoundCommit(
        job_id,
        rnd,
        sha(rnd),
        {"accuracy": 0.1 * rnd},
        10.0 * rnd,
        10.0 * rnd + 2,
        parts,
        aggregator_sha256=sha(100 + rnd),
        scheduler_sha256=sha(200 + rnd),
    )


async def refused(subject: Subject, c: RoundCommit, error: type[Exception] = RoundConflict) -> None:
    """``c`` is refused and leaves the job and its rounds exactly as they were."""
    before = await subject.get_job(c.job_id), await subject.rounds(c.job_id)
    with pytest.raises(error):
        await subject.ledger.commit_round(c)
    assert (await subject.get_job(c.job_id), await subject.rounds(c.job_id)) == before


async def test_rounds_commit_in_order_and_the_last_completes_the_job(subject: Subject) -> None:
    await subject.add_job(job())
    for rnd in range(1, ROUNDS + 1):
        got = await subject.ledger.commit_round(commit(rnd))
        assert got == await subject.get_job("job-1"), "the ledger returns what it stored"
        assert got.rounds_committed == rnd
        assert got.checkpoint_sha256 == sha(rnd)
        assert (got.aggregator_sha256, got.scheduler_sha256) == (sha(100 + rnd), sha(200 + rnd))
        assert got.metrics == {"accuracy": pytest.approx(0.1 * rnd)}
        assert got.state == ("completed" if rnd == ROUNDS else "running")
    assert await subject.rounds("job-1") == [1, 2, 3]


async def test_only_the_next_round_commits(subject: Subject) -> None:
    await subject.add_job(job())
    await refused(subject, commit(2))  # round 1 comes first
    await subject.ledger.commit_round(commit(1))
    await refused(subject, commit(3))  # no skipping ahead
    assert await subject.rounds("job-1") == [1]
    assert (await subject.ledger.commit_round(commit(2))).rounds_committed == 2


async def test_a_round_commits_exactly_once(subject: Subject) -> None:
    await subject.add_job(job())
    await subject.ledger.commit_round(commit(1))
    await refused(subject, commit(1))
    await refused(subject, commit(1, devices=("d3",)))  # another outcome of the same round
    assert await subject.rounds("job-1") == [1]


async def test_nothing_commits_after_the_last_round(subject: Subject) -> None:
    await subject.add_job(job(rounds=1))
    assert (await subject.ledger.commit_round(commit(1))).state == "completed"
    await refused(subject, commit(2))


@pytest.mark.parametrize("state", TERMINAL_STATES)
async def test_nothing_commits_to_a_finished_job(subject: Subject, state: str) -> None:
    await subject.add_job(job())
    await subject.ledger.commit_round(commit(1))
    await subject.ledger.set_job_state("job-1", state)
    await refused(subject, commit(2))


@pytest.mark.parametrize("terminal", TERMINAL_STATES)
async def test_a_finished_job_never_changes_state(subject: Subject, terminal: str) -> None:
    await subject.add_job(job())
    await subject.ledger.set_job_state("job-1", "running")
    await subject.ledger.set_job_state("job-1", terminal)
    for state in JOB_STATES:
        if state == terminal:  # staying put is allowed
            assert (await subject.ledger.set_job_state("job-1", state)).state == terminal
            continue
        with pytest.raises(JobStateError):
            await subject.ledger.set_job_state("job-1", state)
        got = await subject.get_job("job-1")
        assert got is not None and got.state == terminal


async def test_unknown_jobs_and_states_are_refused(subject: Subject) -> None:
    with pytest.raises(NotFoundError):
        await subject.ledger.commit_round(commit(1, job_id="nope"))
    with pytest.raises(NotFoundError):
        await subject.ledger.set_job_state("nope", "running")
    await subject.add_job(job())
    with pytest.raises(ValueError):
        await subject.ledger.set_job_state("job-1", "paused")
    await refused(subject, commit(0), ValueError)
    stray = ParticipationRecord("job-1", 2, "d9", 1, 0.0, 1.0, {})  # another round's
    await refused(subject, dataclasses.replace(commit(1), participants=(stray,)), ValueError)
