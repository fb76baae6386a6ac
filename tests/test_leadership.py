"""The deployment's leader lease in the store, on each database: who may run the jobs,
taking over an expired or dead holder's lease, and round commits fenced by it."""

from __future__ import annotations

import os
import socket

import pytest

from flotilla.core.errors import LeadershipLost
from flotilla.core.records import LeaderFence
from flotilla.server.federation.leadership import dead_here, holder_id
from flotilla.server.federation.store import Store
from tests.test_store import make_commit, make_job

LEASE_S = 10.0


async def test_the_first_taker_leads_others_wait_until_it_expires_then_take_the_next_epoch(
    store: Store,
) -> None:
    first = await store.take_leadership("a", LEASE_S, now=100.0)
    assert first is not None and (first.holder, first.epoch) == ("a", 1)
    assert await store.take_leadership("b", LEASE_S, now=105.0) is None, "a still holds it"
    renewed = await store.take_leadership("a", LEASE_S, now=108.0)
    assert renewed is not None and renewed.epoch == 1 and renewed.expires_at == 118.0
    assert await store.take_leadership("b", LEASE_S, now=117.0) is None
    taken = await store.take_leadership("b", LEASE_S, now=118.5)
    assert taken is not None and (taken.holder, taken.epoch) == ("b", 2)
    assert await store.leadership() == taken
    assert await store.take_leadership("a", LEASE_S, now=119.0) is None, "a lost it"


async def test_a_holder_known_dead_is_replaced_at_once_and_a_released_lease_is_free(
    store: Store,
) -> None:
    await store.take_leadership("a", LEASE_S, now=100.0)
    assert await store.take_leadership("b", LEASE_S, now=101.0, replacing="someone-else") is None
    taken = await store.take_leadership("b", LEASE_S, now=101.0, replacing="a")
    assert taken is not None and taken.epoch == 2
    await store.release_leadership("b")
    again = await store.take_leadership("c", LEASE_S, now=102.0)
    assert again is not None and (again.holder, again.epoch) == ("c", 3)


async def test_a_round_commits_only_under_the_current_unexpired_lease_and_extends_it(
    store: Store,
) -> None:
    await store.add_job(make_job(rounds_total=3))
    lease = await store.take_leadership("a", LEASE_S, now=1000.0)
    assert lease is not None
    commit = make_commit(rnd=1)  # committed_at 2015.25: past this lease's expiry
    with pytest.raises(LeadershipLost, match="expired"):
        await store.commit_round(commit, LeaderFence("a", 1, LEASE_S))
    await store.take_leadership("a", LEASE_S, now=2010.0)
    job = await store.commit_round(commit, LeaderFence("a", 1, LEASE_S))
    assert job.rounds_committed == 1
    extended = await store.leadership()
    assert extended is not None and extended.expires_at == commit.committed_at + LEASE_S
    # Another process took over: the old holder's next commit is refused, nothing written.
    assert await store.take_leadership("b", LEASE_S, now=2100.0) is not None
    with pytest.raises(LeadershipLost, match="another server"):
        await store.commit_round(make_commit(rnd=2), LeaderFence("a", 1, LEASE_S))
    refreshed = await store.get_job("job-1")
    assert refreshed is not None and refreshed.rounds_committed == 1


def test_a_holder_is_dead_only_if_it_named_a_finished_process_of_this_machine() -> None:
    host = socket.gethostname()
    me = holder_id()
    assert me.startswith(f"{host}:{os.getpid()}:") and not dead_here(me)
    assert not dead_here(f"{host}:1:x"), "pid 1 runs"
    assert not dead_here("elsewhere:999999:x"), "another machine's process: cannot tell"
    assert not dead_here("garbage")
    assert dead_here(f"{host}:{2**22 + 12345}:x"), "no such pid"
