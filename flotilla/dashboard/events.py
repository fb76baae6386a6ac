"""``GET /api/v1/events``: the live page's server-sent events.

Each connection subscribes once to the model's changes. What a slow reader has not taken
yet is kept as a set (the same change twice is one refetch), so a stuck browser costs a
few bytes and never holds up the source; a write that does not finish in time ends the
stream, and the page reconnects. A page hears at most one batch of changes per
``min_interval_s``: a job committing ten rounds a second costs each open page one refetch
a second, not ten, and the picture is never more than that interval behind. A comment
line every ``keepalive_s`` keeps proxies from closing an idle stream. Server stop ends
every stream at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass

from aiohttp import web

from flotilla.dashboard import render
from flotilla.dashboard.model import Change, ChangeSource

KEEPALIVE = b": keepalive\n\n"


@dataclass(frozen=True, slots=True)
class StreamSettings:
    keepalive_s: float = 15.0
    #: A write to the browser that takes longer than this ends its stream.
    write_timeout_s: float = 10.0
    #: Changes that come sooner than this after the last batch wait, and go as one batch.
    min_interval_s: float = 1.0


class ChangeStream:
    """One subscriber: its changes deduplicated while it has not taken them."""

    def __init__(self, source: ChangeSource) -> None:
        self._source = source
        self._pending: dict[Change, None] = {}
        self._wake = asyncio.Event()
        self._closed = asyncio.Event()
        self.ended = False

    def close(self) -> None:
        """End the stream (server stop); the handler returns at its next wake-up."""
        self.ended = True
        self._closed.set()
        self._wake.set()

    async def rest(self, seconds: float) -> None:
        """Wait ``seconds`` while changes gather, or until the stream ends."""
        if seconds > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._closed.wait(), seconds)

    async def pump(self) -> None:
        """Move the source's changes into the pending set until the source ends."""
        changes = self._source.changes()
        try:
            async for change in changes:
                self._pending[change] = None
                self._wake.set()
        finally:
            aclose = getattr(changes, "aclose", None)
            if aclose is not None:
                await aclose()
            self.close()

    async def next(self, timeout_s: float) -> list[Change]:
        """The changes since the last call; empty after ``timeout_s`` without any."""
        if not self._pending and not self.ended:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout_s)
        self._wake.clear()
        taken = list(self._pending)
        self._pending.clear()
        return taken


def encode(changes: list[Change]) -> bytes:
    return b"".join(
        b"event: change\ndata: " + json.dumps(render.change_json(c)).encode() + b"\n\n"
        for c in changes
    )


async def serve(
    request: web.Request,
    source: ChangeSource,
    streams: set[ChangeStream],
    settings: StreamSettings,
) -> web.StreamResponse:
    """Stream ``source``'s changes to this request until either side stops."""
    stream = ChangeStream(source)
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-store",
            "X-Accel-Buffering": "no",
        }
    )
    await response.prepare(request)
    streams.add(stream)
    pump = asyncio.ensure_future(stream.pump())
    loop = asyncio.get_running_loop()
    told_at = -settings.min_interval_s
    try:
        await _write(response, b": connected\n\n", settings)
        while not stream.ended and not _gone(request):
            await stream.rest(told_at + settings.min_interval_s - loop.time())
            changes = await stream.next(settings.keepalive_s)
            if stream.ended or _gone(request):
                break
            await _write(response, encode(changes) if changes else KEEPALIVE, settings)
            if changes:
                told_at = loop.time()
    except (ConnectionError, asyncio.TimeoutError):
        pass  # the browser went away or stopped reading: it reconnects when it can
    finally:
        streams.discard(stream)
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await pump
    return response


async def _write(response: web.StreamResponse, data: bytes, settings: StreamSettings) -> None:
    await asyncio.wait_for(response.write(data), settings.write_timeout_s)


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()
