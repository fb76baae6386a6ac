"""Mutual TLS (``flotilla server --tls-client-ca``) on both edges: a device without a
certificate, or with one from another CA, cannot connect; its certificate's name becomes
its device id at enrolment, and a call whose certificate names another device is refused.
Operators keep working: over gRPC with a certificate of their own and the operator token,
over HTTP with the bearer token alone. Every certificate is made here (``tests.support.pki``).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from flotilla.client import Agent, AgentConfig, LocalTrainer
from flotilla.core.device import DeviceProfile
from flotilla.core.errors import AuthError, ConflictError, SpecError, Unreachable
from flotilla.core.timeouts import Timeouts
from flotilla.mobile.lite.http import HttpDevice
from flotilla.proto import PROTOCOL_VERSION
from flotilla.proto import flotilla_pb2 as pb
from flotilla.proto import flotilla_pb2_grpc as pb_grpc
from flotilla.server.app import ServerConfig
from flotilla.tasks import Shard, ShardTraining
from tests.support.live_grpc import DIGITS, LiveServer, live_server, refused
from tests.support.pki import Pair, issue, make_ca

pytestmark = pytest.mark.timeout(90)


@dataclass(frozen=True)
class Pki:
    ca: Path
    server: Pair
    #: Client certificates the CA signed, by the device id (or role) they name.
    clients: dict[str, Pair]
    #: A certificate naming ``dev-a``, signed by a CA the server does not trust.
    stranger: Pair


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    out = tmp_path_factory.mktemp("mtls")
    ca = make_ca("flotilla test CA", out / "ca.pem")
    other = make_ca("some other CA")
    names = ("dev-a", "dev-b", "dev-c", "dev-d", "operator")
    return Pki(
        out / "ca.pem",
        issue(ca, "localhost", out / "server", server=True),
        {name: issue(ca, name, out / name) for name in names},
        issue(other, "dev-a", out / "stranger"),
    )


@pytest.fixture
async def live(tmp_path: Path, pki: Pki) -> AsyncIterator[LiveServer]:
    async with live_server(
        tmp_path / "state",
        tls=(pki.server.cert, pki.server.key, pki.ca),
        tls_client_ca=pki.ca,
        http_port=0,
        timeouts=Timeouts(liveness_s=30.0, poll_hold_s=0.2),
    ) as srv:
        yield srv


def _channel(live: LiveServer, pki: Pki, pair: Pair | None) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=pki.ca.read_bytes(),
        private_key=pair.key.read_bytes() if pair else None,
        certificate_chain=pair.cert.read_bytes() if pair else None,
    )
    return grpc.aio.secure_channel(f"localhost:{live.port}", creds)


async def _enrol(stub: pb_grpc.AgentStub, token: str) -> pb.EnrolReply:
    request = pb.EnrolRequest(
        protocol_version=PROTOCOL_VERSION, token=token, profile=pb.DeviceProfile(tasks=[DIGITS])
    )
    return await stub.Enrol(request, timeout=10)


def _md(reply: pb.EnrolReply) -> tuple[tuple[str, str], ...]:
    return (("x-flotilla-device", reply.device_id), ("authorization", f"Bearer {reply.credential}"))


async def test_grpc_binds_the_certificate_to_the_device_id(live: LiveServer, pki: Pki) -> None:
    a, b = _channel(live, pki, pki.clients["dev-a"]), _channel(live, pki, pki.clients["dev-b"])
    try:
        enrolled = await _enrol(pb_grpc.AgentStub(a), await live.enrol_token())
        assert enrolled.device_id == "dev-a"  # the certificate's CN, not a fresh id
        reply = await pb_grpc.AgentStub(a).Poll(
            pb.PollRequest(), metadata=_md(enrolled), timeout=10
        )
        assert not reply.HasField("task")
        # dev-b's certificate with dev-a's credential: refused, and says why.
        call = pb_grpc.AgentStub(b).Poll(pb.PollRequest(), metadata=_md(enrolled), timeout=10)
        await refused(call, grpc.StatusCode.UNAUTHENTICATED, "names dev-b", "not device 'dev-a'")
        # A second device with dev-a's certificate: the id is taken.
        again = _enrol(pb_grpc.AgentStub(a), await live.enrol_token())
        await refused(again, grpc.StatusCode.FAILED_PRECONDITION, "already enrolled")
    finally:
        await a.close()
        await b.close()
    assert [d.id for d in await live.store.list_devices()] == ["dev-a"]


@pytest.mark.parametrize("who", ["no certificate", "another CA's"])
async def test_grpc_refuses_a_device_without_a_certificate_of_the_ca(
    live: LiveServer, pki: Pki, who: str
) -> None:
    channel = _channel(live, pki, None if who == "no certificate" else pki.stranger)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _enrol(pb_grpc.AgentStub(channel), await live.enrol_token())
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake failed
    finally:
        await channel.close()
    assert await live.store.list_devices() == []


async def test_grpc_operators_present_a_certificate_and_their_token(
    live: LiveServer, pki: Pki
) -> None:
    with_cert = _channel(live, pki, pki.clients["operator"])
    without = _channel(live, pki, None)
    try:
        jobs = await pb_grpc.OperatorStub(with_cert).ListJobs(
            pb.ListJobsRequest(), metadata=live.op_md, timeout=10
        )
        assert list(jobs.jobs) == []
        call = pb_grpc.OperatorStub(with_cert).ListJobs(pb.ListJobsRequest(), timeout=10)
        await refused(call, grpc.StatusCode.UNAUTHENTICATED)  # the cert is not a token
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await pb_grpc.OperatorStub(without).ListJobs(
                pb.ListJobsRequest(), metadata=live.op_md, timeout=10
            )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await with_cert.close()
        await without.close()


async def test_an_agent_enrols_with_its_certificate(
    live: LiveServer, pki: Pki, tmp_path: Path
) -> None:
    pair = pki.clients["dev-d"]
    config = AgentConfig(
        server=f"localhost:{live.port}",
        token=await live.enrol_token(),
        trainer=LocalTrainer(ShardTraining(DIGITS, Shard(0, 4))),
        state_dir=tmp_path / "agent",
        tls_ca=pki.ca,
        tls_cert=pair.cert,
        tls_key=pair.key,
    )
    run = asyncio.ensure_future(Agent(config).run())
    try:
        for _ in range(200):
            if await live.store.get_device("dev-d") is not None:
                break
            assert not run.done(), run
            await asyncio.sleep(0.05)
        assert await live.store.get_device("dev-d") is not None
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)


async def test_http_devices_need_their_own_certificate(live: LiveServer, pki: Pki) -> None:
    url = f"https://localhost:{live.server.http_port}"
    profile = DeviceProfile("", tasks=(DIGITS,))

    def device(name: str | None, stranger: bool = False) -> HttpDevice:
        pair = pki.stranger if stranger else (pki.clients[name] if name else None)
        return HttpDevice(
            url,
            tls_ca=pki.ca,
            retries=0,
            tls_cert=pair.cert if pair else None,
            tls_key=pair.key if pair else None,
        )

    token = await live.enrol_token()
    c = device("dev-c")
    credential = await asyncio.to_thread(c.enrol, token, profile)
    assert credential.device_id == "dev-c"
    assert await asyncio.to_thread(c.poll) is None
    with pytest.raises(ConflictError, match="already enrolled"):
        await asyncio.to_thread(device("dev-c").enrol, token, profile)

    bare = device(None)
    with pytest.raises(AuthError, match="requires a client certificate"):
        await asyncio.to_thread(bare.enrol, token, profile)
    bare.credential = credential
    with pytest.raises(AuthError, match="requires a client certificate"):
        await asyncio.to_thread(bare.poll)
    impostor = device("dev-b")
    impostor.credential = credential
    with pytest.raises(AuthError, match="names dev-b"):
        await asyncio.to_thread(impostor.poll)
    with pytest.raises(Unreachable):  # the handshake fails: the server trusts only its CA
        await asyncio.to_thread(device(None, stranger=True).enrol, token, profile)

    # The operator API on the same port: the bearer token, no certificate needed.
    def jobs() -> object:
        request = urllib.request.Request(
            f"{url}/api/v1/jobs", headers={"Authorization": f"Bearer {live.operator_token}"}
        )
        context = __import__("ssl").create_default_context(cafile=str(pki.ca))
        with urllib.request.urlopen(request, context=context, timeout=10) as answer:
            return json.loads(answer.read())

    assert await asyncio.to_thread(jobs) is not None
    assert [d.id for d in await live.store.list_devices()] == ["dev-c"]


def test_a_client_ca_needs_the_servers_own_certificate(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="--tls-client-ca needs"):
        ServerConfig(state_dir=tmp_path, tls_client_ca=tmp_path / "ca.pem")
