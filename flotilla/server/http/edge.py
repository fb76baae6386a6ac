"""The HTTP edge: aiohttp on the server's event loop, beside the gRPC edge, over the same
:class:`Federation`. The read routes and the page come from :mod:`flotilla.dashboard`; the
live server adds its writes, ``/metrics`` and health. With the gRPC edge's TLS certificate
it serves HTTPS too (tokens never cross the network in clear text when gRPC does not)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from flotilla.core.access import Scope
from flotilla.core.errors import SpecError
from flotilla.dashboard.app import ReadAppConfig, build_read_app
from flotilla.dashboard.guard import SafeAccessLogger
from flotilla.dashboard.model import Change
from flotilla.server.federation.facade import Federation
from flotilla.server.http.connections import ConnectionLimit
from flotilla.server.http.device import DeviceSettings, build_device_app
from flotilla.server.http.feed import LiveFeed
from flotilla.server.http.readmodel import live_read_model
from flotilla.server.http.routes import ServerRoutes
from flotilla.server.metrics import PrometheusMetrics


@dataclass(frozen=True, slots=True)
class HttpSettings:
    host: str
    #: 0 picks a free port.
    port: int
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: Mutual TLS for devices: a client certificate signed by this CA is asked for;
    #: the device protocol requires one, the operator API and dashboard do not.
    tls_client_ca: Path | None = None
    #: Connections one address may hold open at once (``connections``).
    connections_per_address: int = 256
    read: ReadAppConfig = field(default_factory=ReadAppConfig)
    #: Requests in flight at stop get this long (server-sent event streams end at once).
    stop_grace_s: float = 1.0
    #: How often a hosted volunteer run's status is announced as changed.
    volunteers_every_s: float = 5.0
    #: The device protocol under ``/device/v1/``; None: not served.
    device: DeviceSettings | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert and self.tls_key else "http"


class FederationTokens:
    """The dashboard's :class:`~flotilla.dashboard.guard.Authorizer` over the federation's
    operator-API tokens (the operator token and read tokens)."""

    def __init__(self, federation: Federation) -> None:
        self._federation = federation

    async def scope(self, token: str | None) -> Scope:
        return await self._federation.authenticate(token)


class HttpEdge:
    """Built around a federation and the feed among its sinks; ``start`` binds and returns
    the port."""

    def __init__(
        self,
        federation: Federation,
        metrics: PrometheusMetrics,
        feed: LiveFeed,
        settings: HttpSettings,
        ready: Callable[[], bool],
    ) -> None:
        self._federation = federation
        self._feed = feed
        self._settings = settings
        model = live_read_model(federation, feed)
        self.app = build_read_app(model, FederationTokens(federation), "server", settings.read)
        ServerRoutes(federation, metrics, ready).add_to(self.app)
        self._connections = ConnectionLimit(settings.connections_per_address)
        self.app.middlewares.insert(0, self._connections.middleware)
        if settings.device is not None:
            self.app.add_subapp("/device/v1/", build_device_app(federation, settings.device))
        self._runner = web.AppRunner(
            self.app,
            access_log_class=SafeAccessLogger,
            shutdown_timeout=settings.stop_grace_s,
        )
        self._ticker: asyncio.Task[None] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        """The dashboard's address, as the server prints it."""
        s = self._settings
        host = f"[{s.host}]" if ":" in s.host else s.host
        return f"{s.scheme}://{host}:{self.port}/"

    async def start(self) -> int:
        s = self._settings
        context = None
        if s.tls_cert and s.tls_key:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            if s.tls_client_ca:
                # Only this CA vouches for devices (a default context would trust the
                # system's too), and the handshake asks without insisting: browsers reach
                # the dashboard without one; the device protocol refuses calls without.
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                context.minimum_version = ssl.TLSVersion.TLSv1_2
                context.load_verify_locations(cafile=str(s.tls_client_ca))
                context.verify_mode = ssl.CERT_OPTIONAL
            context.load_cert_chain(s.tls_cert, s.tls_key)
        await self._runner.setup()
        assert self._runner.server is not None
        self._connections.watch(self._runner.server)
        site = web.TCPSite(self._runner, s.host, s.port, ssl_context=context)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise SpecError(
                f"the HTTP edge cannot listen on {s.host}:{s.port} ({exc.strerror}): pick "
                "another port with --http-port P (0: a free one), or turn it off with --no-http"
            ) from exc
        self.port = int(self._runner.addresses[0][1])
        self._ticker = asyncio.ensure_future(self._announce_volunteers())
        return self.port

    async def stop(self) -> None:
        """End every event stream, let requests in flight finish, close the port."""
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        self._feed.close()
        await self._runner.cleanup()

    async def _announce_volunteers(self) -> None:
        """A run's peers and loss change every second without an event: tell live pages
        every few seconds while the server hosts any."""
        while True:
            await asyncio.sleep(self._settings.volunteers_every_s)
            if self._federation.volunteer_runs():
                self._feed.tell(Change("volunteers"))
