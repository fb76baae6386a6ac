"""The agent's own logic, against an in-memory server behind MockTransport: no sockets.

Each test runs a real :class:`Agent` whose transport hands every request to ``FakeServer``,
which answers as ``flotilla server`` would (or fails as told), and records what it saw.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import dataclasses
import itertools
import json
import random
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from flotilla.client import Agent, AgentConfig, peer_id
from flotilla.client import agent as agent_module
from flotilla.client.credentials import CREDENTIAL_FILE
from flotilla.client.grpc_transport import GrpcTransport, translate
from flotilla.client.training import TrainOutcome
from flotilla.client.transport import (
    AgentRequest,
    DeviceCredential,
    Enrol,
    FetchModel,
    Heartbeat,
    Leave,
    MockTransport,
    Poll,
    Receipt,
    ReportAverage,
    ReserveUpload,
    SpeedTest,
    SubmitUpdate,
)
from flotilla.core.allreduce import Contribution, GroupAgreement, PeerOptions
from flotilla.core.blobs import sha256_hex
from flotilla.core.device import DeviceProfile
from flotilla.core.errors import (
    AuthError,
    FlotillaError,
    NotFoundError,
    StaleRoundError,
    Unreachable,
    UpdateRejected,
)
from flotilla.core.identity import KEY_FILE, DeviceIdentity
from flotilla.core.timeouts import Timeouts
from flotilla.core.work import ReportVerdict, Reservation, WorkOrder

pytestmark = pytest.mark.timeout(20)

MODEL = b"global model v1 " * 4096  # 64 KiB: several chunks of the fake stream
PAYLOAD = b"encoded update " * 1000
PEER_ID = "QmTestPeer"
#: backoff_cap_s of the agents here: every pause lasts between half of it and all of it.
CAP_S = 0.2


def order(
    round_no: int = 1, model: bytes = MODEL, sha256: str | None = None, job: str = "job-1"
) -> WorkOrder:
    return WorkOrder(
        job_id=job,
        round=round_no,
        round_token=f"token-{job}-{round_no}",
        task="tests:Canned",
        config_json="{}",
        model_sha256=sha256 or sha256_hex(model),
        model_size=len(model),
        deadline=time.time() + 60,
        seed=7 + round_no,
    )


@dataclass
class CannedTrainer:
    """What the agent uses of LocalTrainer: records the model, returns a fixed update."""

    task_name: str = "tests:Canned"
    models: list[bytes] = field(default_factory=list)
    works: list[Any] = field(default_factory=list)
    #: When set, training waits for it (for up to 5 s): a round that takes a while.
    hold: threading.Event | None = None
    #: Server-less rounds: return the update itself, for the all-reduce.
    server_less: bool = False

    def train(self, model_bytes: bytes | memoryview, work: Any) -> TrainOutcome:
        if self.hold is not None:
            self.hold.wait(5.0)
        self.models.append(bytes(model_bytes))
        self.works.append(work)
        if self.server_less:
            return TrainOutcome(8, {"loss": 0.5}, b"", delta={"w": np.ones(3, np.float32)})
        return TrainOutcome(8, {"loss": 0.5}, PAYLOAD)


@dataclass
class FakeServer:
    """Answers the agent's requests in memory and records them, with their times."""

    orders: list[WorkOrder] = field(default_factory=list)
    blobs: dict[str, bytes] = field(default_factory=lambda: {sha256_hex(MODEL): MODEL})
    #: Errors to raise, in turn, for the next requests of a type.
    faults: dict[type, list[FlotillaError]] = field(default_factory=dict)
    heartbeat_open: bool = True
    #: The answers to server-less rounds' reports, in turn.
    verdicts: list[ReportVerdict] = field(default_factory=list)
    seen: list[tuple[float, AgentRequest]] = field(default_factory=list)
    uploads: list[tuple[SubmitUpdate, bytes]] = field(default_factory=list)
    enrolments: int = 0
    #: Set once every order has been handed out and the agent polls again.
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    beaten: threading.Event = field(default_factory=threading.Event)

    def kinds(self) -> list[str]:
        return [type(r).__name__ for _, r in self.seen]

    def of(self, kind: type) -> list[Any]:
        return [r for _, r in self.seen if isinstance(r, kind)]

    async def __call__(self, request: AgentRequest) -> object:
        self.seen.append((time.monotonic(), request))
        pending = self.faults.get(type(request))
        if pending:
            raise pending.pop(0)
        match request:
            case Enrol():
                self.enrolments += 1
                return DeviceCredential("device-1", f"secret-{self.enrolments}")
            case SpeedTest():
                return sum([len(chunk) async for chunk in request.chunks])
            case Poll():
                if self.orders:
                    return self.orders.pop(0)
                self.drained.set()
                await asyncio.sleep(0.01)  # the server's hold, shortened
                return None
            case Heartbeat():
                self.beaten.set()
                return self.heartbeat_open
            case FetchModel():
                return self._stream(self.blobs[request.sha256])
            case ReserveUpload():
                return Reservation(f"room-{request.ref.round}", 10.0)
            case SubmitUpdate():
                data = b"".join([bytes(chunk) async for chunk in request.chunks])
                self.uploads.append((request, data))
                return Receipt(True, "aggregated")
            case ReportAverage():
                return self.verdicts.pop(0)
            case Leave():
                return None
        raise AssertionError(f"unexpected {request!r}")

    @staticmethod
    async def _stream(blob: bytes) -> AsyncIterator[memoryview]:
        view = memoryview(blob)
        for start in range(0, len(view), 16 * 1024):
            yield view[start : start + 16 * 1024]


@pytest.fixture(autouse=True)
def quick_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip the 0.2 s matmul probe and the RSA key of the p2p identity: not under test."""
    monkeypatch.setattr(agent_module, "matmul_gflops", lambda: 1.5)
    monkeypatch.setattr(peer_id, "ensure_identity", lambda path: PEER_ID)


def make_agent(
    server: FakeServer,
    trainer: CannedTrainer | None = None,
    state_dir: Path | None = None,
    timeouts: Timeouts | None = None,
    pauses: PauseCounter | None = None,
    averaging: list[FakeAveraging] | None = None,
) -> tuple[Agent, MockTransport, CannedTrainer]:
    """An agent on ``server``; its server-less rounds' peers are appended to ``averaging``."""
    trainer = trainer or CannedTrainer()
    transport = MockTransport(server)
    config = AgentConfig(
        server="mock:0",
        token="enrol-token",
        trainer=trainer,  # type: ignore[arg-type]
        state_dir=state_dir,
        timeouts=timeouts or Timeouts(),
        speed_test_bytes=4096,
        backoff_cap_s=CAP_S,
        averaging=None
        if averaging is None
        else lambda o: averaging.append(FakeAveraging(o)) or averaging[-1],
    )
    return Agent(config, pauses or PauseCounter(0), transport), transport, trainer


def _recording(made: list[FakeAveraging]) -> Callable[[PeerOptions], FakeAveraging]:
    def make(options: PeerOptions) -> FakeAveraging:
        made.append(FakeAveraging(options))
        return made[-1]

    return make


class PauseCounter(random.Random):
    """An agent's RNG: it draws one jittered delay per backoff pause, so this counts them."""

    draws = 0

    def uniform(self, a: float, b: float) -> float:
        self.draws += 1
        return super().uniform(a, b)


async def run_until(agent: Agent, done: asyncio.Event, timeout_s: float = 5.0) -> None:
    """Run ``agent`` until ``done`` is set, then cancel it as Ctrl-C would."""
    running = asyncio.ensure_future(agent.run())
    waiting = asyncio.ensure_future(done.wait())
    try:
        await asyncio.wait({running, waiting}, timeout=timeout_s, return_when="FIRST_COMPLETED")
        if running.done():
            running.result()  # the agent's own error, if it stopped
            raise AssertionError("the agent stopped by itself")
        assert done.is_set(), f"not done within {timeout_s}s"
    finally:
        waiting.cancel()
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


# --- a round -------------------------------------------------------------------------------


async def test_a_round_fetches_trains_reserves_and_uploads_in_order() -> None:
    work = order()
    server = FakeServer(orders=[work])
    agent, transport, trainer = make_agent(server)
    await run_until(agent, server.drained)

    assert server.kinds()[:7] == [
        "Enrol", "SpeedTest", "Poll", "FetchModel", "ReserveUpload", "SubmitUpdate", "Poll",
    ]  # fmt: skip
    assert server.kinds()[-1] == "Leave"
    assert trainer.models == [MODEL]
    assert [(w.job_id, w.seed) for w in trainer.works] == [(work.job_id, work.seed)]
    [(submit, data)] = server.uploads
    assert data == PAYLOAD
    header = submit.header
    assert header.ref == work.ref
    assert header.reservation == "room-1"
    assert (header.payload_size, header.payload_sha256) == (len(PAYLOAD), sha256_hex(PAYLOAD))
    assert (header.num_samples, dict(header.metrics), header.codec) == (8, {"loss": 0.5}, "none")
    assert agent.rounds_done == 1
    assert agent.device_id == "device-1"
    assert transport.closed


async def test_the_first_poll_carries_the_measured_profile_and_every_poll_the_peer_id() -> None:
    server = FakeServer(orders=[order()])
    agent, _, _ = make_agent(server)
    await run_until(agent, server.drained)

    first, *rest = server.of(Poll)
    assert first.profile is not None
    assert first.profile.tasks == ("tests:Canned",)
    assert first.profile.gflops == 1.5
    assert first.profile.upload_bytes_per_s > 0
    assert rest and all(p.profile is None for p in rest)
    assert all(p.peer_id == PEER_ID for p in [first, *rest])
    assert all(p.credential.secret == "secret-1" for p in [first, *rest])


async def test_a_failed_speed_test_reports_no_upload_rate_and_carries_on() -> None:
    server = FakeServer(orders=[order()], faults={SpeedTest: [Unreachable("UNAVAILABLE")]})
    agent, _, _ = make_agent(server)
    await run_until(agent, server.drained)

    first = server.of(Poll)[0]
    assert first.profile is not None and first.profile.upload_bytes_per_s == 0.0
    assert len(server.uploads) == 1


async def test_a_model_already_held_is_not_fetched_again() -> None:
    server = FakeServer(orders=[order(1), order(2)])
    agent, _, trainer = make_agent(server)
    await run_until(agent, server.drained)

    assert len(server.of(FetchModel)) == 1
    assert trainer.models == [MODEL, MODEL]
    assert [s.header.ref.round for s, _ in server.uploads] == [1, 2]


# --- a server-less round ----------------------------------------------------------------

AGREED_SHA = "ab" * 32
AVERAGE = b"the group's average as safetensors"
GROUP = (Contribution("device-1", 8, {"loss": 0.5}), Contribution("device-2", 6, {"loss": 0.7}))


@dataclass
class FakeAveraging:
    """Stands in for the hivemind all-reduce (the agent's ``averaging`` seam): every member
    agrees on the same model."""

    options: PeerOptions
    calls: list[tuple[str, Contribution, float]] = field(default_factory=list)

    def agree(
        self, key: str, base: memoryview, delta: Any, me: Contribution, left: float, config: Any
    ) -> GroupAgreement:
        self.calls.append((key, me, left))
        return GroupAgreement(AGREED_SHA, AVERAGE, GROUP, "group-7", seconds=0.25, reverted=1)

    def shutdown(self) -> None:
        pass


def server_less_order() -> WorkOrder:
    plan = {"initial_peers": ["/ip4/127.0.0.1/tcp/9/p2p/QmX"], "group_size": 2,
            "min_group_size": 2, "matchmaking_s": 1.0}  # fmt: skip
    return dataclasses.replace(order(), config_json=json.dumps({"p2p": plan}))


async def test_a_server_less_round_reports_the_agreed_model_and_uploads_when_asked() -> None:
    work = server_less_order()
    server = FakeServer(
        orders=[work],
        verdicts=[ReportVerdict(upload=False, round_open=True), ReportVerdict(True, True)],
    )
    made: list[FakeAveraging] = []
    agent, _, _ = make_agent(server, CannedTrainer(server_less=True), averaging=made)
    await run_until(agent, server.drained)

    [averager] = made
    [(key, me, left)] = averager.calls
    assert key == work.round_token and me == Contribution("device-1", 8, {"loss": 0.5})
    assert 0 < left < 60
    reports = server.of(ReportAverage)
    assert len(reports) == 2  # held without a call to upload, it reports again
    for sent in reports:
        assert sent.ref == work.ref
        assert sent.report.model_sha256 == AGREED_SHA
        assert (sent.report.group_id, sent.report.contributors) == ("group-7", GROUP)
        assert (sent.report.allreduce_s, sent.report.reverted) == (0.25, 1)
    [(submit, data)] = server.uploads
    assert data == AVERAGE and submit.header.ref == work.ref
    assert submit.header.payload_sha256 == sha256_hex(AVERAGE)


async def test_a_server_less_round_that_closes_uploads_nothing() -> None:
    server = FakeServer(
        orders=[server_less_order()], verdicts=[ReportVerdict(upload=False, round_open=False)]
    )
    agent, _, _ = make_agent(server, CannedTrainer(server_less=True), averaging=[])
    await run_until(agent, server.drained)

    assert len(server.of(ReportAverage)) == 1
    assert not server.of(ReserveUpload) and not server.uploads


# --- refusals and failures -----------------------------------------------------------------


async def test_a_model_whose_sha256_does_not_match_is_refused_untrained() -> None:
    other = b"global model v2 " * 4096
    tampered = MODEL[:-1] + b"!"
    server = FakeServer(
        orders=[order(1, job="bad", model=MODEL), order(2, job="good", model=other)],
        blobs={sha256_hex(MODEL): tampered, sha256_hex(other): other},
    )
    paused = PauseCounter(0)
    agent, _, trainer = make_agent(server, pauses=paused)
    await run_until(agent, server.drained)

    assert [r.job_id for r in server.of(FetchModel)] == ["bad", "good"]
    # The bad round: fetched, refused, nothing trained or uploaded for it; the next is.
    assert [w.job_id for w in trainer.works] == ["good"]
    assert trainer.models == [other]
    assert [s.header.ref.job_id for s, _ in server.uploads] == ["good"]
    assert [r.ref.job_id for r in server.of(ReserveUpload)] == ["good"]
    # A failure on the device is followed by a pause, as a refusal by the server is not.
    fetched, polled = [t for t, r in server.seen if isinstance(r, (FetchModel, Poll))][1:3]
    assert polled - fetched >= CAP_S / 2
    assert paused.draws == 1


async def test_a_stale_round_refusal_gives_the_round_up_and_polls_again() -> None:
    server = FakeServer(
        orders=[order(1), order(2)],
        faults={ReserveUpload: [StaleRoundError("stale round: the round closed")]},
    )
    paused = PauseCounter(0)
    agent, _, trainer = make_agent(server, pauses=paused)
    await run_until(agent, server.drained)

    assert paused.draws == 0  # a refusal is no reason to wait
    assert len(trainer.models) == 2  # both rounds trained
    assert [s.header.ref.round for s, _ in server.uploads] == [2]  # only the second sent
    kinds = server.kinds()
    refused = kinds.index("ReserveUpload")
    assert kinds[refused + 1] == "Poll"
    assert agent.rounds_done == 1


async def test_a_round_closed_while_training_is_not_uploaded() -> None:
    server = FakeServer(orders=[order()], heartbeat_open=False)
    trainer = CannedTrainer(hold=server.beaten)  # training lasts until a heartbeat answered
    agent, _, _ = make_agent(server, trainer, timeouts=Timeouts(heartbeat_every_s=0.01))
    await run_until(agent, server.drained)

    assert trainer.models == [MODEL]
    assert server.of(Heartbeat)[0].round_token == order().round_token
    assert not server.of(ReserveUpload) and not server.uploads
    assert agent.rounds_done == 0


@pytest.mark.parametrize("refusal", [UpdateRejected("NaN in update"), NotFoundError("no job")])
async def test_a_refused_upload_is_not_retried(refusal: FlotillaError) -> None:
    server = FakeServer(orders=[order()], faults={SubmitUpdate: [refusal]})
    paused = PauseCounter(0)
    agent, _, _ = make_agent(server, pauses=paused)
    await run_until(agent, server.drained)

    assert len(server.of(SubmitUpdate)) == 1
    assert paused.draws == 0
    assert server.kinds()[server.kinds().index("SubmitUpdate") + 1] == "Poll"


# --- reconnecting --------------------------------------------------------------------------


async def test_an_unreachable_server_is_retried_with_backoff_until_it_answers() -> None:
    down = [Unreachable("UNAVAILABLE: connection refused") for _ in range(3)]
    server = FakeServer(orders=[order()], faults={Enrol: down})
    paused = PauseCounter(0)
    agent, _, _ = make_agent(server, pauses=paused)
    await run_until(agent, server.drained)

    enrols = [t for t, r in server.seen if isinstance(r, Enrol)]
    assert len(enrols) == 4
    assert paused.draws == 3
    assert all(gap >= CAP_S / 2 for gap in gaps(enrols)), gaps(enrols)
    assert len(server.uploads) == 1


async def test_an_unreachable_poll_backs_off_then_polls_again() -> None:
    server = FakeServer(orders=[order()], faults={Poll: [Unreachable("DEADLINE_EXCEEDED")] * 2})
    paused = PauseCounter(0)
    agent, _, _ = make_agent(server, pauses=paused)
    await run_until(agent, server.drained)

    polls = [t for t, r in server.seen if isinstance(r, Poll)]
    assert all(gap >= CAP_S / 2 for gap in gaps(polls[:3])), gaps(polls[:3])
    assert server.enrolments == 1  # a server that is away is not a refused credential
    assert paused.draws == 2
    assert len(server.uploads) == 1


async def test_a_refused_credential_enrols_again_and_replaces_the_saved_one(
    tmp_path: Path,
) -> None:
    server = FakeServer(orders=[order()], faults={Poll: [AuthError("unknown device")]})
    paused = PauseCounter(0)
    agent, _, _ = make_agent(server, state_dir=tmp_path, pauses=paused)
    await run_until(agent, server.drained)

    assert server.enrolments == 2
    assert paused.draws == 0
    polls = server.of(Poll)
    assert polls[0].credential.secret == "secret-1"
    assert {p.credential.secret for p in polls[1:]} == {"secret-2"}
    assert [s.credential.secret for s, _ in server.uploads] == ["secret-2"]
    saved = json.loads((tmp_path / CREDENTIAL_FILE).read_text())
    assert (saved["device_id"], saved["secret"]) == ("device-1", "secret-2")


async def test_a_saved_credential_for_this_server_is_used_without_enrolling(
    tmp_path: Path,
) -> None:
    record = {"server": "mock:0", "device_id": "device-9", "secret": "saved"}
    (tmp_path / CREDENTIAL_FILE).write_text(json.dumps(record))
    DeviceIdentity.generate().save(tmp_path / KEY_FILE)  # the key it enrolled with
    server = FakeServer(orders=[order()])
    agent, _, _ = make_agent(server, state_dir=tmp_path)
    await run_until(agent, server.drained)

    assert server.enrolments == 0
    assert {p.credential for p in server.of(Poll)} == {DeviceCredential("device-9", "saved")}
    assert agent.device_id == "device-9"


async def test_a_refused_enrolment_token_stops_the_agent() -> None:
    server = FakeServer(faults={Enrol: [AuthError("unknown token")]})
    agent, transport, _ = make_agent(server)
    with pytest.raises(AuthError, match="refused the enrolment token: unknown token"):
        await asyncio.wait_for(agent.run(), 5.0)
    assert server.kinds() == ["Enrol"]  # no goodbye from a device that never was one
    assert transport.closed


async def test_cancelling_the_agent_tells_the_server_it_leaves() -> None:
    server = FakeServer()
    agent, transport, _ = make_agent(server)
    await run_until(agent, server.drained)

    leave = server.of(Leave)
    assert len(leave) == 1 and server.kinds()[-1] == "Leave"
    assert leave[0].credential == DeviceCredential("device-1", "secret-1")
    assert leave[0].timeout_s > 0
    assert transport.closed


# --- the transports themselves -------------------------------------------------------------


async def test_the_mock_transport_holds_a_request_to_its_deadline() -> None:
    async def slow(request: AgentRequest) -> object:
        await asyncio.sleep(5.0)
        return None

    transport = MockTransport(slow)
    started = time.monotonic()
    with pytest.raises(Unreachable, match="Heartbeat"):
        await transport.send(Heartbeat(DeviceCredential("d", "s"), "t", timeout_s=0.05))
    assert time.monotonic() - started < 2.0


async def test_grpc_to_a_closed_port_is_unreachable() -> None:
    transport = GrpcTransport("127.0.0.1:1")
    try:
        with pytest.raises(Unreachable):
            await transport.send(Enrol("token", DeviceProfile(""), timeout_s=2.0))
    finally:
        await transport.aclose()


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (grpc.StatusCode.UNAUTHENTICATED, AuthError),
        (grpc.StatusCode.FAILED_PRECONDITION, StaleRoundError),
        (grpc.StatusCode.INVALID_ARGUMENT, UpdateRejected),
        (grpc.StatusCode.NOT_FOUND, NotFoundError),
        (grpc.StatusCode.UNAVAILABLE, Unreachable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, Unreachable),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, Unreachable),
        (grpc.StatusCode.INTERNAL, Unreachable),
        (grpc.StatusCode.CANCELLED, Unreachable),
        (grpc.StatusCode.UNIMPLEMENTED, FlotillaError),
    ],
)
def test_grpc_status_codes_become_errors_of_the_one_tree(
    code: grpc.StatusCode, error: type[FlotillaError]
) -> None:
    got = translate(grpc.aio.AioRpcError(code, details="what the server said"))
    assert type(got) is error
    assert "what the server said" in str(got)


def test_the_agent_and_its_seam_import_no_grpc_or_protobuf() -> None:
    """Only the default-transport factory reaches the gRPC transport, and only when used."""
    client = Path(agent_module.__file__).parent
    for name in ("agent.py", "transport.py", "backoff.py", "credentials.py"):
        tree = ast.parse((client / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                assert not module.startswith(("grpc", "flotilla.proto", "google")), (name, module)
                if module == "flotilla.client.grpc_transport":
                    assert name == "agent.py" and node.col_offset > 0, "imported at module level"


async def test_grpc_given_a_deployments_servers_moves_on_from_one_that_is_unreachable(
    tmp_path: Path,
) -> None:
    """``--server A,B``: A is down, so the call to it fails (the agent backs off); the next
    call goes to B, which answers. A server sending the device on answers UNAVAILABLE and
    is passed over alike."""
    from tests.support.live_grpc import live_server

    async with live_server(tmp_path / "state") as live:
        token = await live.enrol_token()
        transport = GrpcTransport(f"127.0.0.1:1,127.0.0.1:{live.port}")
        try:
            enrol = Enrol(token, DeviceProfile("", tasks=("x.y:T",)), timeout_s=5.0)
            with pytest.raises(Unreachable):
                await transport.send(enrol)
            assert transport.server == f"127.0.0.1:{live.port}"
            credential = await transport.send(enrol)
            assert credential.device_id.startswith("dev-")
        finally:
            await transport.aclose()
