"""The client agent that runs on a device.

- ``agent``: :class:`Agent`: enrol, poll, train, upload, reconnect.
- ``config``: :class:`AgentConfig`, and rebuilding a model from a downlink delta.
- ``conditions``: the device's battery, power, network, idleness (a file, or the OS).
- ``training``: :class:`LocalTrainer`: a task's training turned into an encoded update
  (:class:`TrainWork` in, :class:`TrainOutcome` out).
- ``channel``: gRPC channel options, device credentials, backoff.

Never imports server code: a device installs ``flotilla[agent]`` only. Exports load lazily,
so ``import flotilla.client.training`` does not bring in the agent and grpc.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flotilla.client.agent import Agent
    from flotilla.client.channel import Backoff, DeviceCredential, open_channel
    from flotilla.client.config import AgentConfig
    from flotilla.client.training import LocalTrainer, TrainOutcome, TrainWork

_EXPORTS = {
    "Agent": "flotilla.client.agent",
    "AgentConfig": "flotilla.client.config",
    "Backoff": "flotilla.client.channel",
    "DeviceCredential": "flotilla.client.channel",
    "open_channel": "flotilla.client.channel",
    "LocalTrainer": "flotilla.client.training",
    "TrainOutcome": "flotilla.client.training",
    "TrainWork": "flotilla.client.training",
}

__all__ = [
    "Agent",
    "AgentConfig",
    "Backoff",
    "DeviceCredential",
    "LocalTrainer",
    "TrainOutcome",
    "TrainWork",
    "open_channel",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'flotilla.client' has no attribute {name!r}")
