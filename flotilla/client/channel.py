"""The agent's connection: channel options, credentials metadata and retry pacing."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import grpc

MAX_MESSAGE_BYTES = 8 * 1024 * 1024

#: Status codes after which the agent waits and tries again: the server is away or busy.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
    }
)


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


@dataclass(frozen=True, slots=True)
class DeviceCredential:
    device_id: str
    secret: str

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("x-flotilla-device", self.device_id), ("authorization", f"Bearer {self.secret}"))


@dataclass(slots=True)
class Backoff:
    """Capped exponential backoff with full jitter, so a fleet does not reconnect in step."""

    rng: random.Random
    base_s: float = 0.25
    cap_s: float = 10.0
    attempt: int = 0

    def next_delay(self) -> float:
        ceiling = min(self.cap_s, self.base_s * 2**self.attempt)
        self.attempt += 1
        return self.rng.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self.attempt = 0
