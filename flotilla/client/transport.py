"""The agent's seam to a server: one ``send`` over a closed set of requests.

As with httpx's transports, the agent builds requests (frozen values of ``flotilla.core``
types and plain values) and a transport delivers each one, returning its reply. Each
request class names its reply type, so ``await transport.send(Poll(...))`` is typed
``WorkOrder | None``. ``GrpcTransport`` (``client.grpc_transport``) speaks the wire;
:class:`MockTransport` hands each request to a function, for tests of the agent's own
logic; an in-process transport maps each request to one call on the server's facade
(after checking the credential the request carries).

A transport raises only errors of ``flotilla.core.errors``, and the agent acts on them::

    Unreachable      the server is away, busy or too slow: back off, try again
    ForbiddenError   the operator revoked this device: stop (enrolling again is theirs)
    AuthError        the token or credential was refused: enrol again
    UpdateRejected   the server refused this round's request (StaleRoundError: the round
                     closed): give the round up, poll again
    NotFoundError    an unknown job or blob: as UpdateRejected
    anything else    a failed round: log it, back off
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar, cast

from flotilla.core.allreduce import Contribution
from flotilla.core.conditions import DeviceConditions
from flotilla.core.device import DeviceProfile
from flotilla.core.errors import Unreachable
from flotilla.core.work import (
    DeviceCredential,
    ReportVerdict,
    Reservation,
    RoundRef,
    UploadHeader,
    WorkOrder,
)

R = TypeVar("R")

#: Bytes as they travel in chunks; views spare model-sized copies.
Buffer = bytes | memoryview
ByteStream = AsyncIterable[Buffer]


class Request(Generic[R]):
    """Base of the agent's requests; ``R`` is the type of the reply to it.

    Every request carries its own deadline, chosen by the agent: a transport that cannot
    answer within ``timeout_s`` raises :class:`Unreachable`.
    """

    __slots__ = ()
    timeout_s: float


# --- values inside requests and replies ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class AverageReport:
    """A server-less round's outcome as one member saw it."""

    model_sha256: str
    group_id: str
    contributors: tuple[Contribution, ...]
    allreduce_s: float
    reverted: int


@dataclass(frozen=True, slots=True)
class Receipt:
    """The server took the update (``detail`` says what it did with it)."""

    accepted: bool
    detail: str


# --- the requests ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Enrol(Request[DeviceCredential]):
    """Become a device of the server; ``profile.device_id`` is ignored."""

    token: str = field(repr=False)
    profile: DeviceProfile
    timeout_s: float
    #: Hex Ed25519 key the device signs its updates with (``core.identity``).
    public_key: str = ""


@dataclass(frozen=True, slots=True)
class SpeedTest(Request[int]):
    """Stream ``chunks`` to the server; the reply is the bytes it counted."""

    credential: DeviceCredential
    chunks: ByteStream
    timeout_s: float


@dataclass(frozen=True, slots=True)
class Poll(Request[WorkOrder | None]):
    """Ask for work; the server holds the poll a while and replies None if it has none."""

    credential: DeviceCredential
    #: This device's hivemind peer id, "" when it cannot join server-less rounds.
    peer_id: str
    #: Sent when it changed (after a speed test); None otherwise.
    profile: DeviceProfile | None
    timeout_s: float
    #: Battery, power, network, idleness now: which jobs may select the device.
    conditions: DeviceConditions | None = None


@dataclass(frozen=True, slots=True)
class Heartbeat(Request[bool]):
    """Still alive, working on ``round_token``; the reply says whether that round is open."""

    credential: DeviceCredential
    round_token: str
    timeout_s: float
    #: Conditions that no longer meet the job's eligibility end the round (reply False).
    conditions: DeviceConditions | None = None


@dataclass(frozen=True, slots=True)
class FetchModel(Request[AsyncIterator[Buffer]]):
    """Download a blob the device was assigned; the reply yields its bytes in order."""

    credential: DeviceCredential
    job_id: str
    sha256: str
    #: For the whole download, not for each chunk.
    timeout_s: float


@dataclass(frozen=True, slots=True)
class ReserveUpload(Request[Reservation]):
    """Wait for room on the server for an update of ``payload_size`` bytes."""

    credential: DeviceCredential
    ref: RoundRef
    payload_size: int
    timeout_s: float


@dataclass(frozen=True, slots=True)
class SubmitUpdate(Request[Receipt]):
    """Upload an update: the header, then ``chunks`` (the payload in order)."""

    credential: DeviceCredential
    header: UploadHeader
    chunks: ByteStream
    timeout_s: float


@dataclass(frozen=True, slots=True)
class ReportAverage(Request[ReportVerdict]):
    """Report a server-less round's all-reduce; the server may hold the reply a while."""

    credential: DeviceCredential
    ref: RoundRef
    report: AverageReport
    timeout_s: float


@dataclass(frozen=True, slots=True)
class SecAggMessage(Request[bytes]):
    """This device's message for one stage of a secure round; the reply is its message for
    the next stage (b"" after the last), once the stage closes on the server."""

    credential: DeviceCredential
    ref: RoundRef
    stage: int
    body: bytes = field(repr=False)
    timeout_s: float


@dataclass(frozen=True, slots=True)
class GiveUp(Request[None]):
    """This device will not finish the round ``ref`` (its conditions stopped meeting the
    job's eligibility): a dropout now rather than at the deadline."""

    credential: DeviceCredential
    ref: RoundRef
    reason: str
    timeout_s: float


@dataclass(frozen=True, slots=True)
class Leave(Request[None]):
    """This device is going away: free it now rather than at the liveness timeout."""

    credential: DeviceCredential
    reason: str
    timeout_s: float


AgentRequest = (
    Enrol
    | SpeedTest
    | Poll
    | Heartbeat
    | FetchModel
    | ReserveUpload
    | SubmitUpdate
    | ReportAverage
    | SecAggMessage
    | GiveUp
    | Leave
)
#: The closed set, for ``isinstance`` checks.
REQUESTS = (
    Enrol,
    SpeedTest,
    Poll,
    Heartbeat,
    FetchModel,
    ReserveUpload,
    SubmitUpdate,
    ReportAverage,
    SecAggMessage,
    GiveUp,
    Leave,
)


class AgentTransport(Protocol):
    """Delivers the agent's requests to a server."""

    async def send(self, request: Request[R]) -> R:
        """The reply to ``request``, or an error of ``flotilla.core.errors``."""
        ...

    async def aclose(self) -> None:
        """Release connections; ``send`` may open them again."""
        ...


def closed_set(request: Request[R]) -> AgentRequest:
    """``request`` as a member of the closed set, for a transport to dispatch on."""
    if not isinstance(request, REQUESTS):
        raise TypeError(f"{type(request).__name__} is not an agent request")
    return request


Handler = Callable[[AgentRequest], object]


class MockTransport:
    """Hands each request to ``handler`` and returns what it returns (awaited, if it is
    awaitable) or raises what it raises: the agent without a server, for tests.

    The request's deadline holds here too: a handler slower than ``timeout_s`` makes the
    send raise :class:`Unreachable`, as a real transport's would.
    """

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self.closed = False

    async def send(self, request: Request[R]) -> R:
        known = closed_set(request)
        try:
            reply = await asyncio.wait_for(self._answer(known), request.timeout_s)
        except asyncio.TimeoutError:
            raise Unreachable(
                f"{type(request).__name__}: no reply within {request.timeout_s:g}s"
            ) from None
        return cast(R, reply)

    async def _answer(self, request: AgentRequest) -> object:
        reply = self._handler(request)
        if inspect.isawaitable(reply):
            return await cast(Awaitable[object], reply)
        return reply

    async def aclose(self) -> None:
        self.closed = True


__all__ = [
    "REQUESTS",
    "AgentRequest",
    "AgentTransport",
    "AverageReport",
    "Buffer",
    "ByteStream",
    "DeviceCredential",
    "Enrol",
    "FetchModel",
    "GiveUp",
    "Heartbeat",
    "Leave",
    "MockTransport",
    "Poll",
    "Receipt",
    "ReportAverage",
    "ReportVerdict",
    "Request",
    "Reservation",
    "ReserveUpload",
    "SecAggMessage",
    "SpeedTest",
    "SubmitUpdate",
    "UploadHeader",
]
