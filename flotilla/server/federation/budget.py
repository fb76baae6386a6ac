"""Admission control for upload buffers: server memory stays O(model) whatever the fleet size."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class ByteBudget:
    """At most ``capacity`` bytes of upload buffers exist at once; the rest wait their turn.

    Small models then upload concurrently, large ones one or two at a time. A buffer larger
    than the whole budget is admitted alone, so nothing waits forever.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._used = 0
        self._changed = asyncio.Condition()

    @property
    def used(self) -> int:
        return self._used

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        need = await self.acquire(nbytes)
        try:
            yield
        finally:
            await self.release(need)

    async def acquire(self, nbytes: int) -> int:
        """Wait for room; returns what was taken, to hand back to :meth:`release`."""
        need = min(max(nbytes, 0), self.capacity)
        async with self._changed:
            await self._changed.wait_for(lambda: self._used + need <= self.capacity)
            self._used += need
        return need

    async def release(self, taken: int) -> None:
        async with self._changed:
            self._used -= taken
            self._changed.notify_all()
