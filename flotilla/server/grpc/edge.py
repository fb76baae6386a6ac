"""The gRPC edge: a grpc.aio server with the Agent and Operator services over one federation."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc

from flotilla.core.timeouts import Timeouts
from flotilla.proto import bulk, handlers
from flotilla.server.federation.facade import Federation
from flotilla.server.grpc.agent import AgentServicer
from flotilla.server.grpc.limits import CallCap
from flotilla.server.grpc.operator import OperatorServicer
from flotilla.server.grpc.status import guarded


@dataclass(frozen=True, slots=True)
class GrpcSettings:
    host: str
    port: int
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: Mutual TLS: every caller (device or operator) presents a certificate this CA signed.
    tls_client_ca: Path | None = None
    #: Calls one peer address may have in flight at once (``limits.CallCap``).
    calls_per_address: int = 256
    max_message_bytes: int = 8 * 1024 * 1024
    speed_test_max_bytes: int = 16 * 1024 * 1024
    #: A stream that sends or takes nothing for this long is dropped.
    idle_s: float = field(default_factory=lambda: Timeouts().upload_idle_s)


class GrpcEdge:
    """Built around a federation; ``start`` binds and returns the port."""

    def __init__(self, federation: Federation, settings: GrpcSettings) -> None:
        self._settings = settings
        self._server = grpc.aio.server(
            interceptors=[CallCap(settings.calls_per_address)],
            options=[
                ("grpc.max_receive_message_length", settings.max_message_bytes),
                ("grpc.max_send_message_length", settings.max_message_bytes),
                ("grpc.so_reuseport", 0),
                # Notice dead peers on idle connections instead of holding their calls open.
                ("grpc.keepalive_time_ms", 30_000),
                ("grpc.keepalive_timeout_ms", 10_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ],
        )
        agent = AgentServicer(federation, settings.idle_s, settings.speed_test_max_bytes)
        agent_codecs = {
            "FetchModel": handlers.PRESERIALIZED,
            "SubmitUpdate": handlers.Codecs(request_deserializer=bulk.read_update_chunk),
        }
        handlers.register(self._server, "Agent", guarded(agent), agent_codecs)
        operator = OperatorServicer(federation)
        exports = {"ExportModel": handlers.PRESERIALIZED}
        handlers.register(self._server, "Operator", guarded(operator), exports)

    async def start(self) -> int:
        s = self._settings
        address = f"{s.host}:{s.port}"
        if s.tls_cert and s.tls_key:
            ca = s.tls_client_ca.read_bytes() if s.tls_client_ca else None
            creds = grpc.ssl_server_credentials(
                [(s.tls_key.read_bytes(), s.tls_cert.read_bytes())],
                root_certificates=ca,
                require_client_auth=ca is not None,
            )
            port = self._server.add_secure_port(address, creds)
        else:
            port = self._server.add_insecure_port(address)
        await self._server.start()
        return port

    async def stop(self, grace_s: float) -> None:
        await self._server.stop(grace_s)

    async def wait(self) -> None:
        await self._server.wait_for_termination()
