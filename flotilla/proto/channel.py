"""gRPC channels as agents and operators open them: message limits, reconnect pacing, TLS."""

from __future__ import annotations

from pathlib import Path

import grpc

MAX_MESSAGE_BYTES = 8 * 1024 * 1024


def open_channel(
    target: str,
    tls_ca: Path | None = None,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
) -> grpc.aio.Channel:
    """A channel to ``target``: TLS when ``tls_ca`` is given, presenting the client
    certificate ``tls_cert`` (with its key ``tls_key``) when the server asks (mutual TLS)."""
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.enable_retries", 0),
        # Reconnect promptly when a restarted server comes back.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]
    if tls_ca is not None:
        creds = grpc.ssl_channel_credentials(
            root_certificates=Path(tls_ca).read_bytes(),
            private_key=Path(tls_key).read_bytes() if tls_key else None,
            certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None,
        )
        return grpc.aio.secure_channel(target, creds, options=options)
    return grpc.aio.insecure_channel(target, options=options)
