"""A device the test drives call by call through the federation facade (the calls the
gRPC and in-process edges make), to send what a broken, late or departing client sends."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from flotilla.core.device import DeviceProfile
from flotilla.core.identity import DeviceIdentity
from flotilla.core.records import DeviceRecord
from flotilla.core.tensors import DTYPES, encode_state
from flotilla.core.work import RoundRef, UploadHeader
from flotilla.engine.backend import TrainTask
from tests.support.inproc import DIGITS, InProcessFederation


@dataclass
class HandDevice:
    """An enrolled device whose every call the test makes itself, through the facade the
    gRPC and in-process edges call."""

    fed: InProcessFederation
    record: DeviceRecord
    profile: DeviceProfile
    #: The key its uploads are signed with (registered at enrolment).
    identity: DeviceIdentity
    secret: str = ""

    @classmethod
    async def enrol(cls, fed: InProcessFederation) -> HandDevice:
        profile = DeviceProfile("", tasks=(DIGITS,), gflops=1.0)
        identity = DeviceIdentity.generate()
        credential = await fed.federation.enrol(
            await fed.enrol_token(), profile, identity.public_key_hex
        )
        record = await fed.federation.authenticate_device(credential.device_id, credential.secret)
        return cls(fed, record, profile, identity, credential.secret)

    def signed(self, header: UploadHeader) -> UploadHeader:
        """``header`` with a fresh nonce and this device's signature."""
        return sign_header(self.identity, header)

    async def task_of(self, job_id: str, timeout_s: float) -> TrainTask:
        """Poll, as an idle agent does, until a round of ``job_id`` is offered."""

        async def offered() -> TrainTask:
            while True:
                task = await self.fed.federation.poll(self.record, self.profile)
                if task is not None and task.order.job_id == job_id:
                    return task

        return await asyncio.wait_for(offered(), timeout_s)

    async def download(self, task: TrainTask) -> int:
        pieces = self.fed.federation.fetch_model(self.record, task.order.model_sha256)
        return sum([len(p.data) async for p in pieces])

    async def upload(self, task: TrainTask, payload: bytes) -> None:
        async def chunks() -> AsyncIterator[bytes]:
            yield payload

        header = UploadHeader(
            RoundRef(task.order.job_id, task.order.round, task.order.round_token),
            num_samples=10,
            payload_size=len(payload),
            payload_sha256=hashlib.sha256(payload).hexdigest(),
            codec="",
        )
        await self.fed.federation.submit_update(self.record, self.signed(header), chunks())


def sign_header(
    identity: DeviceIdentity, header: UploadHeader, nonce: bytes | None = None
) -> UploadHeader:
    """``header`` signed by ``identity`` over its own fields (a fresh nonce unless given)."""
    ref = header.ref
    signed = identity.sign_update(
        ref.job_id, ref.round, ref.round_token, bytes.fromhex(header.payload_sha256), nonce
    )
    return dataclasses.replace(header, nonce=signed.nonce, signature=signed.signature)


def delta(task: TrainTask, fill: float = 0.0, grow_last: bool = False) -> bytes:
    """An update in the round's layout (or one tensor a column too wide), all ``fill``."""
    state = {}
    for i, spec in enumerate(task.layout):
        shape = spec.shape
        if grow_last and i == 0:
            shape = (*shape[:-1], shape[-1] + 1)
        state[spec.name] = np.full(shape, fill, DTYPES[spec.dtype])
    return encode_state(state)
