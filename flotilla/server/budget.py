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
        need = min(max(nbytes, 0), self.capacity)
        async with self._changed:
            await self._changed.wait_for(lambda: self._used + need <= self.capacity)
            self._used += need
        try:
            yield
        finally:
            async with self._changed:
                self._used -= need
                self._changed.notify_all()
