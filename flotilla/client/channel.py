"""The agent's connection: channel options, credentials metadata and retry pacing."""

from __future__ import annotations

import random
from dataclasses import dataclass

import grpc

from flotilla.proto.channel import MAX_MESSAGE_BYTES, open_channel

__all__ = ["MAX_MESSAGE_BYTES", "RETRYABLE", "Backoff", "DeviceCredential", "open_channel"]

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
