"""The agent's gRPC connection: channel options, credential metadata, retryable codes."""

from __future__ import annotations

import grpc

from flotilla.client.backoff import Backoff
from flotilla.core.work import DeviceCredential
from flotilla.proto.channel import MAX_MESSAGE_BYTES, open_channel

__all__ = [
    "MAX_MESSAGE_BYTES",
    "RETRYABLE",
    "Backoff",
    "DeviceCredential",
    "credential_metadata",
    "open_channel",
]

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


def credential_metadata(credential: DeviceCredential) -> tuple[tuple[str, str], ...]:
    """The call metadata the server authenticates a device by."""
    return (
        ("x-flotilla-device", credential.device_id),
        ("authorization", f"Bearer {credential.secret}"),
    )
