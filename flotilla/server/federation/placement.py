"""Which server process of a deployment runs which job.

Several ``flotilla server`` processes may share one database (PostgreSQL) and one state
directory. Every third of a lease each one announces itself (``Store.announce``), renews
the leases of the jobs it runs and takes its share of the rest: of the unfinished jobs,
``ceil(jobs / live servers)`` each. It takes jobs nobody holds (new ones, those of a
process that stopped or died), and while it holds more than its share it gives one back
per tick, so a server that joins or comes back gets work. It runs exactly the jobs it
holds. Every round commit checks and extends its job's lease in the round's own
transaction (:class:`~flotilla.core.records.LeaseFence`), so a process that lost a job
can never commit to it again, however late it notices.

When a process dies its jobs' leases run out and the others take them within ``lease_s``
plus two ticks (5/3 of a lease), from the last committed round; a holder that is a dead
process on this very machine (a ``kill -9`` then a restart) is replaced at once, and a
clean stop ends its leases at once. Each announcement also carries how many devices the
process's waiting jobs lack, per task (:attr:`JobPlacement.wanted_elsewhere` sums the
others'), so idle devices can be sent where the work is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping

from flotilla.core.errors import LeaseLost, StorageUnavailable
from flotilla.core.lifetime import gone_here
from flotilla.core.records import JobLease, JobRecord, LeaseFence, RoundCommit, ServerPresence
from flotilla.server.federation.store import Store

log = logging.getLogger(__name__)

#: Told the jobs this process now holds (unfinished ones), after every tick.
OnTick = Callable[[frozenset[str]], Awaitable[None]]


def holder_id() -> str:
    """``HOST:PID:RANDOM``: unique per process start, and telling whether it still runs."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def dead_here(holder: str) -> bool:
    """Whether ``holder`` names a process of this machine that no longer runs."""
    host, _, rest = holder.partition(":")
    pid_text = rest.partition(":")[0]
    return pid_text.isdigit() and gone_here(host, int(pid_text))


class JobPlacement:
    """Holds this process's job leases and its place in the deployment."""

    def __init__(
        self,
        store: Store,
        lease_s: float,
        clock: Callable[[], float],
        wanted: Callable[[], Mapping[str, int]],
        on_tick: OnTick,
    ) -> None:
        """``wanted``: devices this process's waiting jobs lack, per task (announced);
        ``on_tick``: told the unfinished jobs held after each tick (runs them, stops the rest)."""
        self.holder = holder_id()
        self._store = store
        self._lease_s = lease_s
        self._clock = clock
        self._wanted = wanted
        self._on_tick = on_tick
        self._held: dict[str, JobLease] = {}
        #: Live servers and unfinished jobs, as of the last tick (a submission adds one).
        self._servers = 1
        self._unfinished = 0
        self._elsewhere: Counter[str] = Counter()
        self._task: asyncio.Task[None] | None = None

    def holds(self, job_id: str) -> bool:
        lease = self._held.get(job_id)
        return lease is not None and lease.expires_at > self._clock()

    def fence(self, job_id: str) -> LeaseFence | None:
        """What this process's commits to ``job_id`` prove (None: it does not hold it)."""
        lease = self._held.get(job_id)
        if lease is None:
            return None
        return LeaseFence(self.holder, lease.epoch, self._lease_s)

    def wanted_elsewhere(self) -> Counter[str]:
        """Devices the other servers' waiting jobs lack, per task, as of the last tick,
        less those sent on since (:meth:`sent`)."""
        return self._elsewhere

    def sent(self, task: str) -> None:
        """One idle device of ``task`` was sent on to the other servers."""
        self._elsewhere[task] -= 1

    async def start(self) -> None:
        """One tick now (a lone server takes every job at once), then one every third of
        a lease."""
        await self.tick()
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Stop ticking; leave the deployment, ending this process's leases, so the
        others take its jobs at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._held.clear()
        with contextlib.suppress(StorageUnavailable):
            await self._store.withdraw(self.holder)

    async def claim(self, job_id: str) -> bool:
        """Take a just-submitted job if this process is under its share (else another
        server's next tick takes it); whether it runs here."""
        self._unfinished += 1
        if len(self._held) >= self._share:
            return False
        lease = await self._store.take_job(job_id, self.holder, self._lease_s, self._clock())
        if lease is None:
            return False
        self._held[job_id] = lease
        log.info("running job %s here (epoch %d)", job_id, lease.epoch)
        return True

    @property
    def _share(self) -> int:
        """Jobs this process should hold: an even split of the unfinished ones."""
        return max(1, math.ceil(self._unfinished / self._servers))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._lease_s / 3)
            try:
                await self.tick()
            except Exception:  # a tick that dies would end this server's share silently
                log.exception("placing jobs failed; trying again at the next tick")

    async def tick(self) -> None:
        """Announce this process, renew and rebalance its leases, run what it holds."""
        try:
            given_back = await self._place()
        except StorageUnavailable as exc:  # the leases run out unless the next tick renews
            log.warning("job leases not renewed: %s", exc)
            given_back = []
        now = self._clock()
        for job_id in [j for j, lease in self._held.items() if lease.expires_at <= now]:
            del self._held[job_id]
            log.warning("lost the lease of job %s: another server may run it", job_id)
        try:
            await self._on_tick(frozenset(self._held))
        except StorageUnavailable as exc:  # runners start at the next tick
            log.warning("jobs not synced with their leases: %s", exc)
            return
        for job_id in given_back:  # its runner stopped above: another server takes it
            with contextlib.suppress(StorageUnavailable):
                await self._store.release_job(job_id, self.holder)

    async def _place(self) -> list[str]:
        """Renew, take and give back leases; the jobs given back (to release once their
        runners are stopped)."""
        store, now = self._store, self._clock()
        wanted = tuple(sorted((t, n) for t, n in self._wanted().items() if n > 0))
        await store.announce(ServerPresence(self.holder, now + self._lease_s, wanted))
        renewals = await store.renew_jobs(self.holder, self._lease_s, now)
        renewed = {lease.job_id: lease for lease in renewals}
        servers = [
            s
            for s in await store.servers(now)
            if s.holder == self.holder or not dead_here(s.holder)
        ]
        self._elsewhere = Counter()
        for server in servers:
            if server.holder != self.holder:
                self._elsewhere.update(dict(server.wanted))
        unfinished = [job.id for job in await store.jobs_to_resume()]
        self._servers, self._unfinished = max(1, len(servers)), len(unfinished)
        for job_id in [j for j in renewed if j not in unfinished]:
            del renewed[job_id]  # finished (or cancelled) here or elsewhere: let it go
            await store.release_job(job_id, self.holder)
        leases = {lease.job_id: lease for lease in await store.job_leases(unfinished)}
        for job_id in unfinished:
            if len(renewed) >= self._share:
                break
            taken = await self._take(leases.get(job_id), job_id, now)
            if taken is not None:
                renewed[job_id] = taken
        for job_id, lease in renewed.items():
            if job_id not in self._held:
                log.info("running job %s here (epoch %d)", job_id, lease.epoch)
        given_back = sorted(renewed)[self._share :] if len(renewed) > self._share else []
        given_back = given_back[:1]  # one a tick: the others' ticks pick it up
        for job_id in given_back:
            del renewed[job_id]
            log.info("giving job %s back: this server holds more than its share", job_id)
        self._held = renewed
        return given_back

    async def _take(self, lease: JobLease | None, job_id: str, now: float) -> JobLease | None:
        """The job's lease if it is free (or its holder died here) and this process got it.
        One of ours that expired is taken like anyone's: it may have gone elsewhere."""
        if lease is None or lease.expires_at <= now:
            return await self._store.take_job(job_id, self.holder, self._lease_s, now)
        if dead_here(lease.holder):
            return await self._store.take_job(
                job_id, self.holder, self._lease_s, now, replacing=lease.holder
            )
        return None


class FencedLedger:
    """The store as the engine's ``Ledger``, every round commit fenced by its job's lease."""

    def __init__(self, store: Store, placement: JobPlacement) -> None:
        self._store = store
        self._placement = placement

    async def commit_round(self, commit: RoundCommit) -> JobRecord:
        fence = self._placement.fence(commit.job_id)
        if fence is None:
            raise LeaseLost(f"job {commit.job_id} runs on another server: not committing")
        return await self._store.commit_round(commit, fence)

    async def set_job_state(self, job_id: str, state: str) -> JobRecord:
        return await self._store.set_job_state(job_id, state)
