"""One load device: enrol, poll, fetch the model, upload an update, on any transport.

It does what a real agent does on the wire (``client.Agent``'s requests, signed uploads)
but trains nothing: its update is small random deltas in the model's layout, made once per
process and reused, so the numbers measure the server, not torch. Every call is timed into
a :class:`Tally`, and every update the server accepts is recorded by round, so the runner
can check afterwards that each accepted update was committed exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from flotilla.client.transport import (
    AgentTransport,
    Buffer,
    Enrol,
    FetchModel,
    Leave,
    Poll,
    ReserveUpload,
    SubmitUpdate,
)
from flotilla.core.blobs import BlobAssembler, iter_chunks, sha256_hex
from flotilla.core.device import DeviceProfile
from flotilla.core.errors import FlotillaError, RateLimited
from flotilla.core.identity import DeviceIdentity, digest_bytes
from flotilla.core.tensors import decode_state, encode_state
from flotilla.core.timeouts import Timeouts
from flotilla.core.work import DeviceCredential, UploadHeader, WorkOrder
from flotilla.loadgen.latency import LatencyHistogram

T = TypeVar("T")

#: The kinds of call a load device times, in the order a round makes them.
CALLS = ("enrol", "poll", "fetch", "reserve", "upload", "leave")
#: The largest model a load device downloads (the synthetic tasks are far below it).
MAX_MODEL_BYTES = 256 * 1024 * 1024
#: Scale of the random update: small, so a long run's model stays finite.
UPDATE_SCALE = 1e-4
#: Pause after a failed call, before the next poll (jittered +-50%).
BACKOFF_S = 1.0


@dataclass(frozen=True, slots=True)
class Accepted:
    """An update the server accepted: ``device`` in round ``round`` of ``job``."""

    job: str
    round: int
    device: str


@dataclass(slots=True)
class Tally:
    """What the devices of one process saw: call latencies, accepted updates, errors."""

    latencies: dict[str, LatencyHistogram] = field(
        default_factory=lambda: {c: LatencyHistogram() for c in CALLS}
    )
    accepted: list[Accepted] = field(default_factory=list)
    #: Uploads the server answered ``accepted = false``.
    not_accepted: int = 0
    #: Errors by class name (StaleRoundError, Unreachable...), each a failed call.
    errors: dict[str, int] = field(default_factory=dict)
    enrolled: int = 0

    async def timed(self, call: str, what: Awaitable[T]) -> T:
        start = time.perf_counter()
        result = await what
        self.latencies[call].add(time.perf_counter() - start)
        return result

    def error(self, exc: BaseException) -> None:
        name = type(exc).__name__
        self.errors[name] = self.errors.get(name, 0) + 1


class CannedUpdate:
    """One update for every device of a process, made from the first model fetched."""

    def __init__(self, seed: int) -> None:
        self._seed = seed
        self._made: tuple[str, bytes, str] | None = None  # model sha, payload, payload sha

    def for_model(self, model_sha256: str, model: bytes | memoryview) -> tuple[bytes, str]:
        """The payload (plain safetensors) and its SHA-256, in ``model``'s layout."""
        if self._made is None or self._made[0] != model_sha256:
            rng = np.random.default_rng(self._seed)
            delta = {
                name: (rng.standard_normal(arr.shape) * UPDATE_SCALE).astype(arr.dtype)
                for name, arr in decode_state(model).items()
            }
            payload = encode_state(delta)
            self._made = (model_sha256, payload, sha256_hex(payload))
        return self._made[1], self._made[2]


@dataclass(frozen=True, slots=True)
class DeviceScript:
    """How a load device behaves."""

    token: str = field(repr=False)
    task: str = ""
    #: Seconds between polls while idle (jittered +-50%): with a server that answers polls
    #: at once (``--poll-hold 0``) this sets each device's request rate; 0 polls again at
    #: once (for a server that holds polls).
    poll_every_s: float = 1.0
    timeouts: Timeouts = field(default_factory=Timeouts)


class LoadDevice:
    """One device's loop over ``transport`` until ``stop`` is set; then it leaves."""

    def __init__(
        self,
        transport: AgentTransport,
        script: DeviceScript,
        update: CannedUpdate,
        tally: Tally,
        rng: random.Random,
    ) -> None:
        self._transport = transport
        self._script = script
        self._update = update
        self._tally = tally
        self._rng = rng
        self._identity = DeviceIdentity.generate()
        self._me: DeviceCredential | None = None

    async def run(self, stop: asyncio.Event) -> None:
        t = self._tally
        while self._me is None and not stop.is_set():
            try:
                self._me = await t.timed("enrol", self._enrol())
                t.enrolled += 1
            except FlotillaError as exc:
                t.error(exc)
                await self._pause(stop, exc)
        while not stop.is_set():
            try:
                order = await t.timed("poll", self._poll())
                if order is None:
                    if self._script.poll_every_s > 0:
                        await self._idle(stop, self._script.poll_every_s)
                    continue
                await self._serve(order)
            except FlotillaError as exc:
                t.error(exc)
                await self._pause(stop, exc)
        if self._me is not None:
            leave = Leave(self._me, "load run over", self._script.timeouts.leave_s)
            try:
                await t.timed("leave", self._transport.send(leave))
            except FlotillaError as exc:
                t.error(exc)

    async def _enrol(self) -> DeviceCredential:
        profile = DeviceProfile(device_id="", tasks=(self._script.task,), gflops=10.0,
                                memory_bytes=2**31, device_class="loadgen")  # fmt: skip
        enrol = Enrol(self._script.token, profile, self._script.timeouts.enrol_s,
                      self._identity.public_key_hex)  # fmt: skip
        return await self._transport.send(enrol)

    async def _poll(self) -> WorkOrder | None:
        assert self._me is not None
        return await self._transport.send(Poll(self._me, "", None, self._script.timeouts.poll_s))

    async def _serve(self, order: WorkOrder) -> None:
        assert self._me is not None
        t, timeouts = self._tally, self._script.timeouts
        model = await t.timed("fetch", self._fetch(order))
        payload, sha = self._update.for_model(order.model_sha256, model)
        wait_s = max(1.0, order.deadline - time.time() + timeouts.upload_grace_s)
        reserve = ReserveUpload(self._me, order.ref, len(payload), wait_s)
        reserved = await t.timed("reserve", self._transport.send(reserve))
        ref = order.ref
        signed = self._identity.sign_update(ref.job_id, ref.round, ref.round_token,
                                            digest_bytes(sha))  # fmt: skip
        header = UploadHeader(
            ref=ref, num_samples=8, payload_size=len(payload), payload_sha256=sha, codec="",
            metrics={"loss": 1.0}, reservation=reserved.key, nonce=signed.nonce,
            signature=signed.signature,
        )  # fmt: skip

        async def chunks() -> AsyncIterator[Buffer]:
            for piece in iter_chunks(payload):
                yield piece

        submit = SubmitUpdate(self._me, header, chunks(), timeouts.transfer_s)
        receipt = await t.timed("upload", self._transport.send(submit))
        if receipt.accepted:
            t.accepted.append(Accepted(ref.job_id, ref.round, self._me.device_id))
        else:
            t.not_accepted += 1

    async def _fetch(self, order: WorkOrder) -> memoryview:
        assert self._me is not None
        assembler = BlobAssembler(order.model_size, order.model_sha256, MAX_MODEL_BYTES)
        fetch = FetchModel(self._me, order.job_id, order.model_sha256,
                           self._script.timeouts.transfer_s)  # fmt: skip
        async for chunk in await self._transport.send(fetch):
            assembler.add(chunk)
        return assembler.finish()

    async def _idle(self, stop: asyncio.Event, seconds: float) -> None:
        delay = seconds * (0.5 + self._rng.random())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)

    async def _pause(self, stop: asyncio.Event, exc: FlotillaError) -> None:
        wait_s = exc.retry_after_s if isinstance(exc, RateLimited) else BACKOFF_S
        await self._idle(stop, wait_s)
