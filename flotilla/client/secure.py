"""A device's side of a secure round (SecAgg+): mask the update, answer every stage.

Instead of uploading, the device hands its clipped update and weight to a
:class:`~flotilla.secagg.SecAggDevice` and trades messages with the server, one stage at a
time, until the server has unmasked the round's sum. The cryptography (and the checks
that make a device stop: a bad signature, a server lying about dropouts, too few
neighbours left) is the library's; this module only carries the messages.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from flotilla.client.transport import AgentTransport, DeviceCredential, SecAggMessage
from flotilla.core.flat import secure_input
from flotilla.core.round_config import SecurePlan
from flotilla.core.tensors import ModelState
from flotilla.core.work import WorkOrder
from flotilla.secagg import SecAggConfig, SecAggDevice, Session, Stage

#: Beyond the server's wait for a stage to close, what a reply may take to arrive.
REPLY_SLACK_S = 10.0

#: Builds the device's SecAgg+ party (a seam for tests that replay its randomness or make
#: it stop at a stage): (config, session, device id, identity key, update, weight).
DeviceFactory = Callable[
    [SecAggConfig, Session, str, Ed25519PrivateKey, np.ndarray, int], SecAggDevice
]


@dataclass(frozen=True, slots=True)
class SecureRound:
    """One device's secure round, ready to run."""

    order: WorkOrder
    plan: SecurePlan
    party: SecAggDevice

    @classmethod
    def start(
        cls,
        order: WorkOrder,
        plan: SecurePlan,
        device_id: str,
        identity: Ed25519PrivateKey,
        delta: ModelState,
        num_samples: int,
        make: DeviceFactory = SecAggDevice,
    ) -> SecureRound:
        vector, weight = secure_input(delta, num_samples, plan.weighting, plan.l2_clip)
        config = SecAggConfig.from_privacy(plan.privacy, len(plan.participants))
        session = Session(order.job_id, order.round, plan.participants)
        party = make(config, session, device_id, identity, vector, weight)
        return cls(order, plan, party)

    def wait_s(self, stage: Stage) -> float:
        """How long to wait for the server's reply to ``stage``."""
        wait = self.plan.privacy.stage_timeout_s + REPLY_SLACK_S
        if stage == Stage.ADVERTISE:  # the first stage closes at the round's deadline
            wait += max(self.order.deadline - time.time(), 0.0)
        return wait

    async def run(self, transport: AgentTransport, me: DeviceCredential) -> None:
        """Every stage; SecAggRefused (with its reason) when the device stops."""
        message = b""
        for stage in Stage:
            body = await asyncio.to_thread(self.party.respond, stage, message)
            request = SecAggMessage(me, self.order.ref, int(stage), body, self.wait_s(stage))
            message = await transport.send(request)
