"""Resources stay flat over many rounds: asyncio tasks, file descriptors, threads and
database connections at round 60 are what they were at round 15.

The server core and real agents share this process (in-process transport), so every count
is this process's, sampled every 10 ms across five whole rounds, and at least
:data:`MIN_SAMPLES` times (rounds of this tiny model can commit faster than a sample a
round), so both windows see every phase of a round (training, uploading, aggregating) and
a task that lives for one phase does not count as growth: the late window's smallest count
is compared with the early window's smallest (tasks: its largest, see the test).
Memory over a long run is the soak's (``benchmarks/load.py``, docs/load.md), where the
server has a process of its own.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.support.inproc import InProcessFederation, poll_until

TASK = "flotilla.tasks.synthetic:Linear100K"
ROUNDS = 80
EARLY, LATE = 15, 60
WINDOW = 5
#: Fewest samples a window takes, however fast its rounds commit.
MIN_SAMPLES = 40


@dataclass(frozen=True)
class Counts:
    tasks: int
    fds: int
    threads: int
    db_connections: int


async def rounds_committed(fed: InProcessFederation, job_id: str) -> int:
    job = await fed.store.get_job(job_id)
    return 0 if job is None else job.rounds_committed


async def at_round(fed: InProcessFederation, job_id: str, rounds: int) -> None:
    async def reached() -> bool:
        return await rounds_committed(fed, job_id) >= rounds

    assert await poll_until(reached, 300), f"round {rounds} not reached"


@dataclass(frozen=True)
class Window:
    """The counts sampled across a window of rounds."""

    least: Counts
    most: Counts
    #: What the live tasks ran when they were fewest, so a failure says which kind grew.
    tasks_at_fewest: Counter[str]


def task_names() -> Counter[str]:
    return Counter(getattr(t.get_coro(), "__qualname__", "?") for t in asyncio.all_tasks())


async def counts_across_rounds(fed: InProcessFederation, job_id: str, start: int) -> Window:
    """Each count sampled from round ``start`` until ``WINDOW`` more commit and at least
    ``MIN_SAMPLES`` were taken."""
    await at_round(fed, job_id, start)
    proc = psutil.Process()
    samples = []
    fewest: Counter[str] = Counter()
    for _ in range(30_000):  # bounded: 300 s at 10 ms
        names = task_names()
        if not samples or names.total() < fewest.total():
            fewest = names
        fds, threads = proc.num_fds(), threading.active_count()
        samples.append(Counts(names.total(), fds, threads, fed.store.connections_in_use()))
        enough = len(samples) >= MIN_SAMPLES
        if enough and await rounds_committed(fed, job_id) >= start + WINDOW:
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError(f"rounds {start}..{start + WINDOW} did not commit")
    fields = Counts.__dataclass_fields__
    least = Counts(*(min(getattr(s, f) for s in samples) for f in fields))
    most = Counts(*(max(getattr(s, f) for s in samples) for f in fields))
    return Window(least, most, fewest)


@pytest.mark.timeout(400)
async def test_tasks_fds_threads_and_db_connections_stay_flat_over_many_rounds(
    in_process: InProcessFederation, tmp_path: Path
) -> None:
    await in_process.start_agents(6, task=TASK)
    spec = tmp_path / "job.toml"
    spec.write_text(
        f'[job]\nname = "flat"\ntask = "{TASK}"\nrounds = {ROUNDS}\nclients_per_round = 4\n'
        "min_quorum = 2\nround_deadline_s = 20.0\n"
    )
    job_id = await in_process.submit(spec)
    early = await counts_across_rounds(in_process, job_id, EARLY)
    late_window = await counts_across_rounds(in_process, job_id, LATE)
    late = late_window.least
    # Tasks: the fewest late against the most early. On a loaded machine stragglers can
    # keep agents training (one heartbeat task each) through a whole window; a task leaked
    # each round would still show as dozens more after 45 rounds.
    grown = late.tasks - early.most.tasks
    assert grown <= 2, (early, late, late_window.tasks_at_fewest - early.tasks_at_fewest)
    assert late.fds <= early.least.fds + 4, (early, late)
    assert late.threads <= early.least.threads + 2, (early, late)
    assert late.db_connections <= max(early.least.db_connections, 1), (early, late)
    status = await in_process.wait_for(job_id, timeout=300)
    assert status["state"] == "completed"
