"""Reading a stream from a peer that may go quiet: every edge bounds the wait per item."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator
from typing import TypeVar

from flotilla.core.errors import WireError

T = TypeVar("T")


async def paced(items: AsyncIterable[T], idle_s: float, what: str) -> AsyncIterator[T]:
    """``items`` as they arrive; WireError naming ``what`` once none comes for ``idle_s``
    (a sender that stalls mid-stream must not hold a handler or a buffer forever)."""
    stream = aiter(items)
    while True:
        try:
            item = await asyncio.wait_for(anext(stream, None), idle_s)
        except asyncio.TimeoutError:
            raise WireError(f"{what} stalled: no data for {idle_s:.0f}s") from None
        if item is None:
            return
        yield item
