"""The durable record of refused updates: an event sink that writes them to the store.

``UpdateRefused`` events are emitted synchronously on the upload path; this sink only
queues them, and one background task writes what has queued in a single transaction, so
an upload's refusal never waits on the database. The queue is bounded: a flood of
refusals (a device hammering with forged uploads) costs memory up to ``max_queued`` and
then drops the oldest, counting what it dropped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable

from flotilla.core.events import Event, UpdateRefused
from flotilla.core.records import RefusalRecord
from flotilla.server.federation.store import Store

log = logging.getLogger(__name__)

#: Refusals waiting for the writer; beyond this the oldest are dropped (and counted).
MAX_QUEUED = 10_000


class RefusalLog:
    """Writes every refused update to the ``refusals`` table, off the upload path."""

    def __init__(
        self, store: Store, clock: Callable[[], float], max_queued: int = MAX_QUEUED
    ) -> None:
        self._store = store
        self._clock = clock
        self._queue: collections.deque[RefusalRecord] = collections.deque(maxlen=max_queued)
        self._wake = asyncio.Event()
        self._writing = asyncio.Lock()
        self._writer: asyncio.Task[None] | None = None
        #: Refusals dropped because the queue was full (logged, never silently).
        self.dropped = 0

    def emit(self, event: Event) -> None:
        if not isinstance(event, UpdateRefused):
            return
        if len(self._queue) == self._queue.maxlen:
            self.dropped += 1
        self._queue.append(
            RefusalRecord(
                self._clock(), event.device_id, event.job_id, event.round, event.reason,
                event.detail,
            )
        )  # fmt: skip
        self._wake.set()

    def start(self) -> None:
        if self._writer is None:
            self._writer = asyncio.ensure_future(self._write_forever())

    async def flush(self) -> None:
        """Write whatever has queued, and wait for a write under way: once this returns,
        every refusal emitted before the call is in the store."""
        async with self._writing:
            while self._queue:
                batch = list(self._queue)
                self._queue.clear()
                try:
                    await self._store.add_refusals(batch)
                except asyncio.CancelledError:
                    self._queue.extendleft(reversed(batch))  # close() writes them
                    raise
                except Exception:  # best effort: the upload was refused either way
                    log.exception("could not record %d refused updates", len(batch))
                    return

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
            self._writer = None
        await self.flush()
        if self.dropped:
            log.warning("%d refused updates were not recorded (queue full)", self.dropped)

    async def _write_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.flush()
