"""The client agent that runs on a device.

- ``agent``: :class:`Agent` and :class:`AgentConfig`: enrol, poll, train, upload, reconnect.
- ``training``: :class:`LocalTrainer`: a task's training turned into an encoded update.
- ``channel``: gRPC channel options, device credentials, backoff.
- ``profile``: what the agent measures about its device.

Never imports server code: a device installs ``flotilla[agent]`` only.
"""

from flotilla.client.agent import Agent, AgentConfig
from flotilla.client.channel import Backoff, DeviceCredential, open_channel
from flotilla.client.training import LocalTrainer, TrainOutcome

__all__ = [
    "Agent",
    "AgentConfig",
    "Backoff",
    "DeviceCredential",
    "LocalTrainer",
    "TrainOutcome",
    "open_channel",
]
