"""The in-process transport: each agent request is one call of the federation facade, and
the agent hears what it would hear over gRPC.

The agent acts on an error's class (``flotilla.client.transport``): so for every error the
core raises, the class the in-process transport passes on must be the one the gRPC edge's
status table and ``GrpcTransport``'s table together make of it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from flotilla.client.grpc_transport import _ENROL_ERRORS, _ERRORS
from flotilla.client.transport import Enrol, FetchModel, Heartbeat, Leave, Poll, SpeedTest
from flotilla.core.device import DeviceProfile
from flotilla.core.errors import (
    AuthError,
    BudgetExhausted,
    ConflictError,
    FlotillaError,
    IntegrityError,
    JobStateError,
    NotFoundError,
    SpecError,
    StaleRoundError,
    Unreachable,
    UpdateRejected,
    WireError,
)
from flotilla.core.work import DeviceCredential
from flotilla.inprocess import InProcessTransport, agent_error
from flotilla.server.grpc.status import status_of
from tests.support.inproc import InProcessFederation

pytestmark = pytest.mark.timeout(60)

CORE_ERRORS = (
    AuthError("who are you"),
    NotFoundError("no such blob"),
    SpecError("bad field"),
    WireError("bad bytes"),
    IntegrityError("bad checksum"),
    UpdateRejected("not finite"),
    StaleRoundError("round closed"),
    JobStateError("job finished"),
    ConflictError("duplicate"),
    BudgetExhausted("epsilon spent"),
    FlotillaError("anything else"),
)


@pytest.mark.parametrize("enrolling", [False, True], ids=["after-enrolment", "enrol"])
@pytest.mark.parametrize("error", CORE_ERRORS, ids=lambda e: type(e).__name__)
def test_the_agent_hears_each_core_error_as_over_grpc(
    error: FlotillaError, enrolling: bool
) -> None:
    code = status_of(error)
    assert code is not None
    table = _ENROL_ERRORS if enrolling else _ERRORS
    over_grpc = table.get(code, FlotillaError)
    heard = agent_error(error, enrolling=enrolling)
    assert isinstance(heard, over_grpc), (type(heard), over_grpc)
    # Classes the agent tells apart: none more specific than gRPC's either.
    for cls in (AuthError, Unreachable, UpdateRejected, StaleRoundError, NotFoundError):
        assert isinstance(heard, cls) == issubclass(over_grpc, cls), cls
    assert str(error) in str(heard)


async def _chunks(count: int, size: int) -> AsyncIterator[bytes]:
    for _ in range(count):
        yield bytes(size)


async def test_requests_reach_the_facade_with_their_credentials(
    in_process: InProcessFederation,
) -> None:
    transport = InProcessTransport(in_process.federation)
    profile = DeviceProfile("", tasks=("flotilla.tasks.digits:DigitsTask",))
    with pytest.raises(AuthError, match="enrolment token refused"):
        await transport.send(Enrol("wrong", profile, timeout_s=5))
    me = await transport.send(Enrol(await in_process.enrol_token(), profile, timeout_s=5))
    assert me.device_id.startswith("dev-")
    assert [d["id"] for d in await in_process.devices()] == [me.device_id]

    impostor = DeviceCredential(me.device_id, "not-the-secret")
    for request in (
        Heartbeat(impostor, "token", timeout_s=5),
        Poll(impostor, "", None, timeout_s=5),
        Leave(impostor, "bye", timeout_s=5),
    ):
        with pytest.raises(AuthError, match="refused"):
            await transport.send(request)

    assert await transport.send(SpeedTest(me, _chunks(3, 1000), timeout_s=5)) == 3000
    assert await transport.send(Heartbeat(me, "no-such-round", timeout_s=5)) is False
    pieces = await transport.send(FetchModel(me, "job", "0" * 64, timeout_s=5))
    with pytest.raises(StaleRoundError, match="not assigned"):
        async for _ in pieces:
            pass


async def test_a_request_past_its_deadline_is_unreachable(
    in_process: InProcessFederation,
) -> None:
    """No job, so the server holds the poll (for seconds); the agent's deadline wins."""
    transport = InProcessTransport(in_process.federation)
    profile = DeviceProfile("", tasks=("flotilla.tasks.digits:DigitsTask",))
    me = await transport.send(Enrol(await in_process.enrol_token(), profile, timeout_s=5))
    with pytest.raises(Unreachable, match=r"Poll: no reply within 0\.3s"):
        await transport.send(Poll(me, "", None, timeout_s=0.3))


async def test_an_overlong_speed_test_is_refused(in_process: InProcessFederation) -> None:
    transport = InProcessTransport(in_process.federation, speed_test_max_bytes=4096)
    profile = DeviceProfile("", tasks=("flotilla.tasks.digits:DigitsTask",))
    me = await transport.send(Enrol(await in_process.enrol_token(), profile, timeout_s=5))
    with pytest.raises(FlotillaError, match="speed test too long"):
        await transport.send(SpeedTest(me, _chunks(5, 1000), timeout_s=5))
