"""The live feed: the federation's events as the dashboard's :class:`Change` values, handed
to every subscriber without ever making the federation wait.

:class:`LiveFeed` is an :class:`~flotilla.core.events.EventSink`: ``emit`` runs inside a
round's commit or a device's poll, so it only translates the event and drops the change
into each subscriber's pending set (the same change twice is one refetch; the set is
bounded by the number of jobs). A subscriber that does not read keeps at most that set.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from flotilla.core.events import (
    DeviceChanged,
    DeviceFailed,
    Event,
    JobChanged,
    RoundCommitted,
    UpdateAccepted,
)
from flotilla.dashboard.model import Change

log = logging.getLogger(__name__)

DEVICES = Change("devices")


def changes_of(event: Event) -> tuple[Change, ...]:
    """What a live view must refetch after ``event`` (nothing for most events)."""
    if isinstance(event, RoundCommitted):
        # Its devices are free again and have served one more round.
        return (Change("job", event.job_id), DEVICES)
    if isinstance(event, JobChanged):
        return (Change("job", event.job_id), DEVICES)
    if isinstance(event, (DeviceChanged, DeviceFailed, UpdateAccepted)):
        return (DEVICES,)
    return ()


class _Subscriber:
    def __init__(self, limit: int) -> None:
        self.pending: dict[Change, None] = {}
        self.wake = asyncio.Event()
        self.closed = False
        self._limit = limit

    def put(self, change: Change) -> None:
        if change not in self.pending and len(self.pending) >= self._limit:
            return  # a subscriber this far behind refetches everything on reconnect anyway
        self.pending[change] = None
        self.wake.set()


class LiveFeed:
    """Fans the federation's changes out to any number of subscribers; ``hooks`` hear each
    change synchronously, inside ``emit`` (the read model marks what it must refetch)."""

    def __init__(self, max_pending: int = 4096) -> None:
        self._subscribers: set[_Subscriber] = set()
        self._hooks: list[Callable[[Change], None]] = []
        self._max_pending = max_pending
        self._closed = False

    def on_change(self, hook: Callable[[Change], None]) -> None:
        self._hooks.append(hook)

    def emit(self, event: Event) -> None:
        for change in changes_of(event):
            self.tell(change)

    def tell(self, change: Change) -> None:
        """Hand ``change`` to every hook and subscriber (also for changes no event names,
        such as a volunteer run's status)."""
        for hook in self._hooks:
            try:
                hook(change)
            except Exception:
                log.exception("live feed hook failed on %s", change)
        for subscriber in self._subscribers:
            subscriber.put(change)

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    async def changes(self) -> AsyncIterator[Change]:
        """Changes from now on, until :meth:`close` or the caller stops iterating."""
        subscriber = _Subscriber(self._max_pending)
        subscriber.closed = self._closed
        self._subscribers.add(subscriber)
        try:
            while not subscriber.closed:
                await subscriber.wake.wait()
                subscriber.wake.clear()
                taken = list(subscriber.pending)
                subscriber.pending.clear()
                for change in taken:
                    yield change
        finally:
            self._subscribers.discard(subscriber)

    def close(self) -> None:
        """End every subscription (server stop); later ones end at once."""
        self._closed = True
        for subscriber in self._subscribers:
            subscriber.closed = True
            subscriber.wake.set()
