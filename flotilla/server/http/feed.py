"""The live feed: the federation's events as the dashboard's :class:`Change` values, handed
to every subscriber without ever making the federation wait.

:class:`LiveFeed` is an :class:`~flotilla.core.events.EventSink`: ``emit`` runs inside a
round's commit or a device's poll, so it only translates the event and records it, at a
cost that does not grow with the number of subscribers. A subscriber that falls behind
gets each distinct change it missed once (the same change twice is one refetch).
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


class LiveFeed:
    """Fans the federation's changes out to any number of subscribers; hooks hear each
    event synchronously, inside ``emit`` (the read model keeps up with them).

    ``emit`` costs the same whatever the number of subscribers: it stamps the change with
    a sequence number in one table of the latest stamp per distinct change, and resolves
    the one future every waiting subscriber awaits. Each subscriber keeps only the stamp it
    has read up to, and on waking takes the changes stamped after it, newest first until
    one it has seen: a subscriber that stopped reading holds nothing.
    """

    def __init__(self, min_interval_s: float = 1.0) -> None:
        """``min_interval_s``: a ``devices`` or ``volunteers`` change is told at most this
        often (every accepted update changes a device; a page refetching the device table
        fifty times a round would cost the round more than it shows)."""
        self._min_interval_s = min_interval_s
        self._told_at: dict[str, float] = {}
        self._held: set[Change] = set()
        self._hooks: list[Callable[[Event], None]] = []
        self._seq = 0
        #: Distinct change -> the sequence number of its latest occurrence, oldest first.
        self._latest: dict[Change, int] = {}
        self._next: asyncio.Future[None] | None = None
        self._closed = False
        self.subscribers = 0

    def on_event(self, hook: Callable[[Event], None]) -> None:
        """``hook`` hears each event inside ``emit``, before any subscriber hears of it."""
        self._hooks.append(hook)

    def emit(self, event: Event) -> None:
        for hook in self._hooks:
            try:
                hook(event)
            except Exception:
                log.exception("live feed hook failed on %s", event)
        for change in changes_of(event):
            self.tell(change)

    def tell(self, change: Change) -> None:
        """Hand ``change`` to every subscriber (also for changes no event names, such as a
        volunteer run's status)."""
        if change.kind == "job":
            self._publish(change)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop, so no subscriber either
            return
        if change in self._held:
            return
        wait = self._told_at.get(change.kind, -1e9) + self._min_interval_s - loop.time()
        if wait <= 0:
            self._publish(change)
        else:
            self._held.add(change)
            loop.call_later(wait, self._release, change)

    def _release(self, change: Change) -> None:
        self._held.discard(change)
        if not self._closed:
            self._publish(change)

    def _publish(self, change: Change) -> None:
        if change.kind != "job":
            self._told_at[change.kind] = asyncio.get_running_loop().time()
        self._seq += 1
        self._latest.pop(change, None)
        self._latest[change] = self._seq
        self._wake()

    def _wake(self) -> None:
        if self._next is not None and not self._next.done():
            self._next.set_result(None)
        self._next = None

    def _since(self, seen: int) -> list[Change]:
        newer = []
        for change, seq in reversed(self._latest.items()):
            if seq <= seen:
                break
            newer.append(change)
        newer.reverse()
        return newer

    async def changes(self) -> AsyncIterator[Change]:
        """Changes from now on, until :meth:`close` or the caller stops iterating."""
        seen = self._seq
        self.subscribers += 1
        try:
            while not self._closed:
                if self._seq == seen:
                    if self._next is None:
                        self._next = asyncio.get_running_loop().create_future()
                    await asyncio.shield(self._next)
                    continue
                taken, seen = self._since(seen), self._seq
                for change in taken:
                    yield change
        finally:
            self.subscribers -= 1

    def close(self) -> None:
        """End every subscription (server stop); later ones end at once."""
        self._closed = True
        self._wake()
