"""Jobs shared by the server processes of a deployment, on each database: one lease per
job in the store (taken when free, expired or held by a dead process; every round commit
fenced by it), and the placement each process runs on top (an even share each, jobs of a
stopped or dead process taken over, one given back per tick to a process that joins)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import pytest

from flotilla.core.errors import LeaseLost, StorageUnavailable
from flotilla.core.records import LeaseFence, ServerPresence
from flotilla.server.federation.placement import FencedLedger, JobPlacement, dead_here, holder_id
from flotilla.server.federation.store import Store
from tests.test_store import make_commit, make_job

LEASE_S = 10.0


async def test_the_first_taker_holds_a_job_others_wait_until_it_expires_then_take_the_next_epoch(
    store: Store,
) -> None:
    first = await store.take_job("job-1", "a", LEASE_S, now=100.0)
    assert first is not None and (first.holder, first.epoch) == ("a", 1)
    assert await store.take_job("job-1", "b", LEASE_S, now=105.0) is None, "a still holds it"
    assert await store.take_job("job-2", "b", LEASE_S, now=105.0) is not None, "per job"
    renewed = await store.renew_jobs("a", LEASE_S, now=108.0)
    assert [(r.job_id, r.epoch, r.expires_at) for r in renewed] == [("job-1", 1, 118.0)]
    assert await store.take_job("job-1", "b", LEASE_S, now=117.0) is None
    assert await store.renew_jobs("a", LEASE_S, now=118.5) == [], "an expired lease stays so"
    taken = await store.take_job("job-1", "b", LEASE_S, now=118.5)
    assert taken is not None and (taken.holder, taken.epoch) == ("b", 2)
    assert await store.take_job("job-1", "a", LEASE_S, now=119.0) is None, "a lost it"
    assert {(x.job_id, x.holder) for x in await store.job_leases()} == {
        ("job-1", "b"), ("job-2", "b")
    }  # fmt: skip


async def test_a_holder_known_dead_is_replaced_at_once_and_a_released_lease_is_free(
    store: Store,
) -> None:
    await store.take_job("job-1", "a", LEASE_S, now=100.0)
    assert await store.take_job("job-1", "b", LEASE_S, now=101.0, replacing="other") is None
    taken = await store.take_job("job-1", "b", LEASE_S, now=101.0, replacing="a")
    assert taken is not None and taken.epoch == 2
    await store.release_job("job-1", "b")
    again = await store.take_job("job-1", "c", LEASE_S, now=102.0)
    assert again is not None and (again.holder, again.epoch) == ("c", 3)


async def test_a_round_commits_only_under_its_jobs_current_unexpired_lease_and_extends_it(
    store: Store,
) -> None:
    await store.add_job(make_job(rounds_total=3))
    assert await store.take_job("job-1", "a", LEASE_S, now=1000.0) is not None
    commit = make_commit(rnd=1)  # committed_at 2015.25: past this lease's expiry
    with pytest.raises(LeaseLost, match="expired"):
        await store.commit_round(commit, LeaseFence("a", 1, LEASE_S))
    await store.take_job("job-1", "a", LEASE_S, now=2010.0)
    job = await store.commit_round(commit, LeaseFence("a", 1, LEASE_S))
    assert job.rounds_committed == 1
    [extended] = await store.job_leases()
    assert extended.expires_at == commit.committed_at + LEASE_S
    # Another process took the job over: the old holder's next commit is refused.
    assert await store.take_job("job-1", "b", LEASE_S, now=2100.0) is not None
    with pytest.raises(LeaseLost, match="another server"):
        await store.commit_round(make_commit(rnd=2), LeaseFence("a", 1, LEASE_S))
    refreshed = await store.get_job("job-1")
    assert refreshed is not None and refreshed.rounds_committed == 1


async def test_servers_announce_themselves_until_they_expire_or_withdraw(store: Store) -> None:
    await store.announce(ServerPresence("a", 110.0, (("mnist", 3),)))
    await store.announce(ServerPresence("b", 105.0))
    await store.announce(ServerPresence("b", 120.0))  # refreshed
    assert await store.servers(now=108.0) == [
        ServerPresence("a", 110.0, (("mnist", 3),)), ServerPresence("b", 120.0)
    ]  # fmt: skip
    assert [s.holder for s in await store.servers(now=111.0)] == ["b"]
    await store.take_job("job-1", "b", LEASE_S, now=111.0)
    await store.withdraw("b")
    assert await store.servers(now=111.0) == []
    assert await store.take_job("job-1", "c", LEASE_S, now=111.0) is not None, "leases ended"


def test_a_holder_is_dead_only_if_it_named_a_finished_process_of_this_machine() -> None:
    host = socket.gethostname()
    me = holder_id()
    assert me.startswith(f"{host}:{os.getpid()}:") and not dead_here(me)
    assert not dead_here(f"{host}:1:x"), "pid 1 runs"
    assert not dead_here("elsewhere:999999:x"), "another machine's process: cannot tell"
    assert not dead_here("garbage")
    assert dead_here(f"{host}:{2**22 + 12345}:x"), "no such pid"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Process:
    """One server process's placement, with what its ticks told it to run."""

    def __init__(self, store: Store, clock: Clock, wanted: Mapping[str, int] = {}) -> None:
        self.running: frozenset[str] = frozenset()
        self.placement = JobPlacement(store, LEASE_S, clock, lambda: wanted, self._on_tick)

    async def _on_tick(self, held: frozenset[str]) -> None:
        self.running = held


async def tick(*processes: Process, rounds: int = 1) -> None:
    for _ in range(rounds):
        for p in processes:
            await p.placement.tick()


async def test_servers_split_the_jobs_take_over_a_stopped_ones_and_share_with_a_newcomer(
    store: Store,
) -> None:
    for i in range(4):
        await store.add_job(make_job(f"job-{i}"))
    clock = Clock()
    a, b = Process(store, clock), Process(store, clock)
    await tick(a, b, rounds=3)
    assert len(a.running) == len(b.running) == 2 and not a.running & b.running
    await a.placement.stop()  # a clean stop ends its leases at once
    await tick(b)
    assert len(b.running) == 4
    c = Process(store, clock)
    await tick(c, b, rounds=4)  # b gives one back per tick; c takes it
    assert len(c.running) == len(b.running) == 2 and not c.running & b.running
    assert all(b.placement.fence(j) for j in b.running)
    assert all(b.placement.fence(j) is None for j in c.running)


async def test_a_silent_servers_jobs_are_taken_over_once_their_leases_run_out(
    store: Store,
) -> None:
    await store.add_job(make_job("job-1"))
    clock = Clock()
    a, b = Process(store, clock), Process(store, clock)
    await tick(a, b)
    assert a.running == {"job-1"} and not b.running
    clock.now += LEASE_S * 0.9  # a stopped ticking (it hangs, or died elsewhere)
    await tick(b)
    assert not b.running, "a's lease still holds"
    clock.now += LEASE_S * 0.2
    await tick(b)
    assert b.running == {"job-1"}
    await tick(a)  # a wakes up: the lease is gone, its commits refused
    assert not a.running
    ledger = FencedLedger(store, a.placement)
    with pytest.raises(LeaseLost, match="another server"):
        await ledger.commit_round(make_commit(rnd=1))


async def test_each_server_hears_what_devices_the_others_jobs_lack(store: Store) -> None:
    clock = Clock()
    a = Process(store, clock, wanted={"mnist": 3, "cifar": 0})
    b = Process(store, clock, wanted={"mnist": 1})
    await tick(a, b, rounds=2)
    assert dict(b.placement.wanted_elsewhere()) == {"mnist": 3}
    assert dict(a.placement.wanted_elsewhere()) == {"mnist": 1}
    b.placement.sent("mnist")
    assert b.placement.wanted_elsewhere()["mnist"] == 2


async def test_a_job_submitted_to_a_server_under_its_share_runs_there_at_once(
    store: Store,
) -> None:
    clock = Clock()
    a, b = Process(store, clock), Process(store, clock)
    await store.add_job(make_job("job-1"))
    await tick(a, b, rounds=2)  # each has seen the other
    await store.add_job(make_job("job-2"))
    assert not await a.placement.claim("job-2"), "a holds its share (1 of 2 jobs, 2 servers)"
    assert await b.placement.claim("job-2")
    assert b.placement.holds("job-2")


async def test_a_tick_that_cannot_reach_the_store_leaves_the_jobs_for_the_next(
    store: Store,
) -> None:
    """The database went away mid-tick (here: while the runners were being synced): the
    tick says so and returns; the next one runs the held jobs."""
    await store.add_job(make_job("job-1"))
    outages = [StorageUnavailable("database unavailable: restarting")]
    running: list[frozenset[str]] = []

    async def on_tick(held: frozenset[str]) -> None:
        if outages:
            raise outages.pop()
        running.append(held)

    placement = JobPlacement(store, LEASE_S, Clock(), dict, on_tick)
    await placement.tick()
    assert running == [] and placement.holds("job-1")
    await placement.tick()
    assert running == [frozenset({"job-1"})]
