"""gRPC channels as agents and operators open them: message limits, reconnect pacing, TLS."""

from __future__ import annotations

from pathlib import Path

import grpc

MAX_MESSAGE_BYTES = 8 * 1024 * 1024


def open_channel(target: str, tls_ca: Path | None = None) -> grpc.aio.Channel:
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.enable_retries", 0),
        # Reconnect promptly when a restarted server comes back.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]
    if tls_ca is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
        return grpc.aio.secure_channel(target, creds, options=options)
    return grpc.aio.insecure_channel(target, options=options)
