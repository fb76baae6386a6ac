"""A cap on the connections one address holds open on the HTTP edge at once.

aiohttp tells its :class:`~aiohttp.web.Server` of every connection made and lost; this
wraps those two calls on the edge's own server. A connection over its address's cap is
kept just long enough to answer each request on it with 429 (``Retry-After``, then
``Connection: close``), so the flooding client is told why, and no handler runs for it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web

from flotilla.dashboard import render
from flotilla.dashboard.guard import RouteHandler
from flotilla.server.federation.ratelimit import ConcurrencyCap

__all__ = ["ConnectionLimit"]


def _address(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)


class ConnectionLimit:
    """At most ``limit`` open connections per client address."""

    def __init__(self, limit: int) -> None:
        self.cap = ConcurrencyCap(limit)
        #: Connection (its request handler) -> address, for those within the cap.
        self._held: dict[object, str] = {}
        #: Connections over the cap: their requests are answered 429.
        self._over: set[object] = set()

    def watch(self, server: web.Server) -> None:
        """Count ``server``'s connections from now on (call once, before it listens)."""
        made: Callable[..., None] = server.connection_made
        lost: Callable[..., None] = server.connection_lost

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            made(handler, transport)
            key = _address(transport)
            if self.cap.enter(key):
                self._held[handler] = key
            else:
                self._over.add(handler)

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            self._over.discard(handler)
            key = self._held.pop(handler, None)
            if key is not None:
                self.cap.leave(key)
            lost(handler, exc)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]

    @web.middleware
    async def middleware(self, request: web.Request, handler: RouteHandler) -> web.StreamResponse:
        if request.protocol in self._over:
            message = (
                f"rate limited: more than {self.cap.limit} connections open from "
                f"{request.remote}; close some, or retry later"
            )
            return web.Response(
                status=429,
                body=render.dumps(render.error_json("rate_limited", message)),
                content_type="application/json",
                headers={"Retry-After": "1", "Connection": "close"},
            )
        return await handler(request)
