"""Which server process of a deployment runs the jobs and serves devices.

Several ``flotilla server`` processes may share one database (PostgreSQL) and one state
directory. One of them, the leader, holds a lease row in the database (``Store``'s
``take_leadership``): it runs every job and serves devices. The others are standbys: they
serve operators (reads, submissions, cancellations go through the shared database) and
refuse device calls with :class:`~flotilla.core.errors.Standby`, so a device moves on to
the next server it was given. Every round commit checks and extends the lease in the round's
own transaction (:class:`~flotilla.core.records.LeaderFence`), so a process that lost it can
never commit again, however late it notices.

Each process tries every third of a lease to take or renew it. When the leader dies, a
standby takes over once the lease expires (within ``lease_s`` plus a third of it) and
resumes every job from its last committed round. A holder that is a dead process on this
very machine (a ``kill -9`` then a restart) is replaced at once; a clean stop releases the
lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable

from flotilla.core.errors import LeadershipLost, StorageUnavailable
from flotilla.core.records import JobRecord, LeaderFence, Leadership, RoundCommit
from flotilla.server.federation.store import Store

log = logging.getLogger(__name__)

Transition = Callable[[], Awaitable[None]]


def holder_id() -> str:
    """``HOST:PID:RANDOM``: unique per process start, and telling whether it still runs."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def dead_here(holder: str) -> bool:
    """Whether ``holder`` names a process of this machine that no longer runs."""
    host, _, rest = holder.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        return False
    return False


class LeaderLease:
    """Takes and renews the lease; tells the server when it leads and when it lost it."""

    def __init__(
        self,
        store: Store,
        lease_s: float,
        clock: Callable[[], float],
        on_lead: Transition,
        on_loss: Transition,
    ) -> None:
        """``on_lead`` runs at every attempt that finds this process leading (the first,
        and every renewal: it is idempotent); ``on_loss`` when the lease is lost."""
        self.holder = holder_id()
        self._store = store
        self._lease_s = lease_s
        self._clock = clock
        self._on_lead = on_lead
        self._on_loss = on_loss
        self._held: Leadership | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def leading(self) -> bool:
        held = self._held
        return held is not None and held.expires_at > self._clock()

    def fence(self) -> LeaderFence | None:
        """What this process's round commits prove (None while it is a standby)."""
        held = self._held
        if held is None:
            return None
        return LeaderFence(self.holder, held.epoch, self._lease_s)

    async def start(self) -> None:
        """One attempt now (a lone server leads at once), then one every third of a lease."""
        await self.attempt()
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Stop trying; release the lease if held, so a standby takes over at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._held is not None:
            self._held = None
            with contextlib.suppress(StorageUnavailable):
                await self._store.release_leadership(self.holder)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._lease_s / 3)
            await self.attempt()

    async def attempt(self) -> None:
        """Take or renew the lease; on a change, run the transition it calls for."""
        try:
            current = await self._store.leadership()
            replacing = current.holder if current and dead_here(current.holder) else ""
            held = await self._store.take_leadership(
                self.holder, self._lease_s, self._clock(), replacing
            )
        except StorageUnavailable as exc:
            log.warning("leader lease not renewed: %s", exc)
            held = self._held if self.leading else None
        was, self._held = self._held, held
        changed = was is None or held is None or held.epoch != was.epoch
        if was is not None and changed:  # lost (or lost and retaken: start afresh)
            log.warning("lost the leader lease: standing by")
            await self._on_loss()
        if held is not None and changed:
            log.info("leading the deployment (epoch %d)", held.epoch)
        if held is not None:
            try:
                await self._on_lead()
            except StorageUnavailable as exc:  # the next attempt tries again
                log.warning("leading, but the store is unavailable: %s", exc)


class FencedLedger:
    """The store as the engine's ``Ledger``, every round commit fenced by the lease."""

    def __init__(self, store: Store, lease: LeaderLease) -> None:
        self._store = store
        self._lease = lease

    async def commit_round(self, commit: RoundCommit) -> JobRecord:
        fence = self._lease.fence()
        if fence is None:
            raise LeadershipLost("standing by: this server does not commit rounds")
        return await self._store.commit_round(commit, fence)

    async def set_job_state(self, job_id: str, state: str) -> JobRecord:
        return await self._store.set_job_state(job_id, state)
