"""The composition root: a store, the federation core, its gRPC edge, the reaper and the
hivemind peers the server hosts, started and stopped together.

Everything a device or operator does goes through :class:`Federation`; the gRPC edge
(:class:`GrpcEdge`) and the HTTP edge (:class:`HttpEdge`: the JSON API, ``/metrics`` and the
dashboard) are built here over the same federation, on the same event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from flotilla.core.blobs import CHUNK_BYTES
from flotilla.core.errors import SpecError
from flotilla.core.events import EventSink
from flotilla.core.records import JobRecord
from flotilla.core.timeouts import Timeouts
from flotilla.engine import EngineConfig
from flotilla.server.federation import auth
from flotilla.server.federation.budget import ByteBudget
from flotilla.server.federation.facade import Federation, FederationConfig
from flotilla.server.federation.ports import Hosted
from flotilla.server.federation.ratelimit import RateLimits
from flotilla.server.federation.store import Store, default_url
from flotilla.server.grpc.edge import GrpcEdge, GrpcSettings
from flotilla.server.hosting.rendezvous import HostedRendezvous
from flotilla.server.hosting.volunteers import VolunteerHost, VolunteerRunSpec
from flotilla.server.http.device import DeviceSettings
from flotilla.server.http.edge import HttpEdge, HttpSettings
from flotilla.server.http.feed import LiveFeed
from flotilla.server.memory import release_free_memory
from flotilla.server.metrics import PrometheusMetrics
from flotilla.tasks.runtime import LocalTasks

log = logging.getLogger(__name__)

STATE_FILE = "server.json"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    state_dir: Path = Path("flotilla-state")
    db_url: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: Mutual TLS: devices present a certificate this CA signed, naming their device id
    #: (both edges); gRPC operators present one too. Needs ``tls_cert`` and ``tls_key``.
    tls_client_ca: Path | None = None
    #: Per-device polls and uploads, per-address enrolments and connections.
    rate_limits: RateLimits = field(default_factory=RateLimits)
    timeouts: Timeouts = field(default_factory=Timeouts)
    engine: EngineConfig = field(default_factory=EngineConfig)
    #: Bytes of update buffers held at once (one update always fits): bounds server memory
    #: to O(model) whatever the fleet size, while small models still upload concurrently.
    upload_budget_bytes: int = 64 * 1024 * 1024
    max_message_bytes: int = 8 * 1024 * 1024
    speed_test_max_bytes: int = 16 * 1024 * 1024
    #: Model downloads streamed at once; the rest wait. Each stream in flight holds
    #: gRPC buffers, so this bounds server memory under a fleet-wide fetch.
    download_slots: int = 2
    download_chunk_bytes: int = CHUNK_BYTES
    #: Volunteer runs to coordinate (the ``p2p`` extra), and where their peers listen.
    volunteer_runs: tuple[VolunteerRunSpec, ...] = ()
    #: Where this server's hivemind peers (volunteer coordinators, the rendezvous of
    #: server-less rounds) listen, and the addresses they announce; loopback by default.
    p2p_host_maddrs: tuple[str, ...] | None = None
    p2p_announce_maddrs: tuple[str, ...] | None = None
    #: The HTTP edge (JSON API, ``/metrics``, dashboard): its port (0 picks a free one;
    #: None turns it off) and host (None: the gRPC ``host``).
    http_port: int | None = 7071
    http_host: str | None = None

    def __post_init__(self) -> None:
        if self.tls_client_ca is not None and not (self.tls_cert and self.tls_key):
            raise SpecError(
                "--tls-client-ca needs the server's own certificate: give --tls-cert and "
                "--tls-key too (clients verify the server before it verifies them)"
            )

    def federation(self) -> FederationConfig:
        return FederationConfig(
            state_dir=Path(self.state_dir),
            timeouts=self.timeouts,
            engine=self.engine,
            download_slots=self.download_slots,
            download_chunk_bytes=self.download_chunk_bytes,
            rate_limits=self.rate_limits,
            client_certs=self.tls_client_ca is not None,
        )

    def grpc(self) -> GrpcSettings:
        return GrpcSettings(
            host=self.host,
            port=self.port,
            tls_cert=self.tls_cert,
            tls_key=self.tls_key,
            tls_client_ca=self.tls_client_ca,
            calls_per_address=self.rate_limits.grpc_calls_per_address,
            max_message_bytes=self.max_message_bytes,
            speed_test_max_bytes=self.speed_test_max_bytes,
            idle_s=self.timeouts.upload_idle_s,
        )

    def http(self) -> HttpSettings | None:
        """The HTTP edge's settings; None when it is off. It serves HTTPS with the gRPC
        edge's certificate when there is one."""
        if self.http_port is None:
            return None
        return HttpSettings(
            host=self.http_host or self.host,
            port=self.http_port,
            tls_cert=self.tls_cert,
            tls_key=self.tls_key,
            tls_client_ca=self.tls_client_ca,
            connections_per_address=self.rate_limits.http_connections_per_address,
            stop_grace_s=self.timeouts.server_stop_s,
            device=DeviceSettings(Path(self.state_dir) / "device-uploads", self.timeouts),
        )


class FederationServer:
    """Owns every long-lived part; ``start`` resumes the jobs a previous run left running.

    The federation's events go to :attr:`metrics` (Prometheus, served at ``/metrics``), to
    :attr:`feed` (the dashboard's live changes) and to every sink in ``sinks`` or added with
    :meth:`add_sink` before :meth:`start`."""

    def __init__(self, config: ServerConfig, sinks: tuple[EventSink, ...] = ()) -> None:
        self.config = config
        self.metrics = PrometheusMetrics()
        self.feed = LiveFeed()
        self._sinks: list[EventSink] = [self.metrics, self.feed, *sinks]
        self.state_dir = Path(config.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.upload_budget = ByteBudget(config.upload_budget_bytes)
        self.volunteers = VolunteerHost(
            config.volunteer_runs,
            self.state_dir / "volunteer",
            config.p2p_host_maddrs,
            config.timeouts,
        )
        self.rendezvous = HostedRendezvous(
            self.state_dir / "rendezvous",
            config.p2p_host_maddrs,
            config.p2p_announce_maddrs,
            config.timeouts,
        )
        self.store: Store
        self.federation: Federation
        self.port = 0
        #: The HTTP edge's port once started; None when it is off.
        self.http_port: int | None = None
        self._edge: GrpcEdge | None = None
        self._http: HttpEdge | None = None
        self._ready = False
        self._reaper: asyncio.Task[None] | None = None

    def add_sink(self, sink: EventSink) -> None:
        """Send the federation's events to ``sink`` too; only before :meth:`start`."""
        if hasattr(self, "federation"):
            raise RuntimeError("add event sinks before start(): the federation holds its own")
        self._sinks.append(sink)

    @property
    def db_url(self) -> str:
        return self.config.db_url or default_url(self.state_dir)

    async def start(self) -> int:
        self.store = await Store.open(self.db_url, self.config.timeouts.db_busy_s)
        await self._ensure_operator_token()
        self.federation = Federation(
            self.config.federation(),
            self.store,
            self.upload_budget,
            Hosted(rendezvous=self.rendezvous, volunteers=self.volunteers),
            LocalTasks(),
            sinks=tuple(self._sinks),
        )
        self.metrics.watch_devices(self.federation.device_counts)
        self._edge = GrpcEdge(self.federation, self.config.grpc())
        self.port = await self._edge.start()
        http = self.config.http()
        if http is not None:
            await self._start_http(http)
        state = {
            "host": self.config.host,
            "port": self.port,
            "db_url": self.db_url,
            "http_host": http.host if http else None,
            "http_port": self.http_port,
        }
        (self.state_dir / STATE_FILE).write_text(json.dumps(state))
        self._reaper = asyncio.ensure_future(self._reap())
        await self.federation.start()
        await self.volunteers.start()
        self._ready = True
        log.info("listening on %s:%d", self.config.host, self.port)
        if self._http is not None:
            log.info("dashboard: %s", self._http.url)
        return self.port

    @property
    def http_edge(self) -> HttpEdge | None:
        """The HTTP edge once started; None when it is off."""
        return self._http

    @property
    def dashboard_url(self) -> str | None:
        """``http://HOST:PORT/`` of the HTTP edge (the dashboard); None when it is off."""
        return self._http.url if self._http is not None else None

    async def _start_http(self, settings: HttpSettings) -> None:
        self._http = HttpEdge(self.federation, self.metrics, self.feed, settings, self._serving)
        try:
            self.http_port = await self._http.start()
        except BaseException:
            assert self._edge is not None
            await self._edge.stop(0)
            await self.store.close()
            raise

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop everything; calls in flight get ``grace_s`` (default
        ``Timeouts.server_stop_s``) to finish."""
        self._ready = False
        if self._http is not None:  # first: no API call reaches a closing federation
            await self._http.stop()
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reaper
        await self.federation.close()
        await self.volunteers.stop()
        await self.rendezvous.stop()
        if self._edge is not None:
            grace = self.config.timeouts.server_stop_s if grace_s is None else grace_s
            await self._edge.stop(grace)
        await self.store.close()

    def _serving(self) -> bool:
        """Ready for devices: started and not stopping."""
        return self._ready

    async def wait(self) -> None:
        assert self._edge is not None, "start() first"
        await self._edge.wait()

    async def submit_job(self, spec_json: str) -> JobRecord:
        """Submit a job from this process (the demo does), as an operator would."""
        return await self.federation.submit_job(spec_json)

    async def _ensure_operator_token(self) -> None:
        path = self.state_dir / auth.OPERATOR_TOKEN_FILE
        if path.exists():
            token = path.read_text().strip()
            if await self.store.has_operator_token(auth.hash_secret(token)):
                return
        token = auth.new_secret()
        await self.store.add_operator_token(auth.hash_secret(token))
        auth.write_private(path, token + "\n")

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.config.timeouts.liveness_s / 4))
            for device_id in self.federation.reap():
                log.info("device %s went silent", device_id)
            release_free_memory()
