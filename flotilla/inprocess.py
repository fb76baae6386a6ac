"""The agent's transport to a federation in the same process: no sockets, no wire format.

:class:`InProcessTransport` delivers each of the agent's requests
(``flotilla.client.transport``) as one call on the server's transport-free facade
(``flotilla.server.federation.Federation``), after checking the credential the request
carries through the facade, as the gRPC edge does. Like httpx's ``MockTransport`` it is a
seam for tests, and it is how a notebook runs a whole federation (server core and real
agents) in one event loop.

It sits above both sides: the client never imports the server and the server never
imports the client, so the one module that knows both lives at the top, beside the CLI.

What the agent hears is what it would hear over gRPC: the core's own error when its class
already means the same to the agent, otherwise the error class the gRPC edge and
``GrpcTransport`` together turn it into (a malformed request is refused like an
unacceptable one; any other refusal after enrolment means the round is no longer this
one), with the core's message and the core's error as its cause.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar, cast

from flotilla.client.transport import (
    AgentRequest,
    Buffer,
    Enrol,
    FetchModel,
    GiveUp,
    Heartbeat,
    Leave,
    Poll,
    Receipt,
    ReportAverage,
    Request,
    ReserveUpload,
    SecAggMessage,
    SpeedTest,
    SubmitUpdate,
    closed_set,
)
from flotilla.core.errors import (
    AuthError,
    FlotillaError,
    NotFoundError,
    SpecError,
    StaleRoundError,
    Unreachable,
    UpdateRejected,
    WireError,
)
from flotilla.core.records import DeviceRecord
from flotilla.core.work import DeviceCredential
from flotilla.engine.backend import Reported
from flotilla.server.federation.facade import Federation
from flotilla.server.federation.views import BlobSlice

R = TypeVar("R")

#: Bytes a speed test may send, as the gRPC edge's default allows.
SPEED_TEST_MAX_BYTES = 16 * 1024 * 1024
#: Errors the agent acts on by their class, whenever raised: passed through as they are.
_AS_IS = (AuthError, NotFoundError, Unreachable)
#: Malformed or unacceptable requests (gRPC: INVALID_ARGUMENT): the agent hears a refused
#: update (a stale round, an UpdateRejected too, is FAILED_PRECONDITION instead).
_REFUSED = (WireError, SpecError, UpdateRejected)


class InProcessTransport:
    """Sends an agent's requests to ``federation`` in this process.

    Every request keeps its deadline: a call slower than ``timeout_s`` raises
    :class:`Unreachable`, as a real transport's would.
    """

    def __init__(
        self, federation: Federation, speed_test_max_bytes: int = SPEED_TEST_MAX_BYTES
    ) -> None:
        self._federation = federation
        self._speed_test_max_bytes = speed_test_max_bytes

    async def send(self, request: Request[R]) -> R:
        known = closed_set(request)
        try:
            reply = await asyncio.wait_for(self._dispatch(known), known.timeout_s)
        except asyncio.TimeoutError:
            raise Unreachable(
                f"{type(known).__name__}: no reply within {known.timeout_s:g}s"
            ) from None
        except FlotillaError as exc:
            raise agent_error(exc, enrolling=isinstance(known, Enrol)) from exc
        return cast(R, reply)

    async def aclose(self) -> None:
        """Nothing to release: no connection is held between requests."""

    async def _device(self, credential: DeviceCredential) -> DeviceRecord:
        return await self._federation.authenticate_device(credential.device_id, credential.secret)

    async def _dispatch(self, r: AgentRequest) -> object:
        fed = self._federation
        match r:
            case Enrol():
                return await fed.enrol(r.token, r.profile, r.public_key)
            case SpeedTest():
                await self._device(r.credential)
                return await self._count(r)
            case Poll():
                device = await self._device(r.credential)
                task = await fed.poll(device, r.profile, r.peer_id, r.conditions)
                return None if task is None else task.order
            case Heartbeat():
                device = await self._device(r.credential)
                return fed.heartbeat(device, r.round_token, r.conditions)
            case GiveUp():
                fed.report_failure(await self._device(r.credential), r.ref, r.reason)
                return None
            case FetchModel():
                device = await self._device(r.credential)
                deadline = asyncio.get_running_loop().time() + r.timeout_s
                return _download(fed, device, r.sha256, deadline)
            case ReserveUpload():
                device = await self._device(r.credential)
                return await fed.reserve_upload(device, r.ref, r.payload_size)
            case SubmitUpdate():
                device = await self._device(r.credential)
                await fed.submit_update(device, r.header, aiter(r.chunks))
                return Receipt(accepted=True, detail="aggregated")
            case ReportAverage():
                device = await self._device(r.credential)
                report = Reported(
                    device_id=device.id,
                    elapsed_s=0.0,
                    model_sha256=r.report.model_sha256,
                    group_id=r.report.group_id,
                    contributors=r.report.contributors,
                    allreduce_s=r.report.allreduce_s,
                    reverted=r.report.reverted,
                )
                return await fed.report_average(device, r.ref, report)
            case SecAggMessage():
                device = await self._device(r.credential)
                return await fed.secagg(device, r.ref, r.stage, r.body)
            case Leave():
                fed.leave(await self._device(r.credential), r.reason)
                return None
        raise TypeError(f"{type(r).__name__} has no in-process call")  # pragma: no cover

    async def _count(self, request: SpeedTest) -> int:
        total = 0
        async for chunk in request.chunks:
            total += len(chunk)
            if total > self._speed_test_max_bytes:
                raise FlotillaError("speed test too long")
        return total


def agent_error(exc: FlotillaError, enrolling: bool = False) -> FlotillaError:
    """``exc`` as the agent hears it over gRPC (see the module docstring)."""
    if isinstance(exc, _AS_IS):
        return exc
    if isinstance(exc, _REFUSED) and not isinstance(exc, StaleRoundError):
        return exc if isinstance(exc, UpdateRejected) else UpdateRejected(str(exc))
    # FAILED_PRECONDITION: at enrolment a refusal; after it, the round is no longer this one.
    if enrolling:
        return FlotillaError(str(exc))
    return exc if isinstance(exc, StaleRoundError) else StaleRoundError(str(exc))


async def _download(
    federation: Federation, device: DeviceRecord, sha256: str, deadline: float
) -> AsyncIterator[Buffer]:
    """The blob's bytes in order, within ``deadline`` for the whole download."""
    loop = asyncio.get_running_loop()
    pieces: AsyncGenerator[BlobSlice, None] = federation.fetch_model(device, sha256)
    try:
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise Unreachable("FetchModel: the download outlasted its deadline")
            try:
                piece = await asyncio.wait_for(anext(pieces), left)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise Unreachable("FetchModel: the download outlasted its deadline") from None
            except FlotillaError as exc:
                raise agent_error(exc) from exc
            yield piece.data
    finally:
        await pieces.aclose()


__all__ = ["InProcessTransport", "agent_error"]
