"""Who may talk to a real server: credentials on every RPC, enrolment, tokens, and TLS.

A refused call says why (UNAUTHENTICATED with a detail), and leaves no trace: every row of
every table is the same afterwards, and the round it tried to touch still commits normally.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import os
import stat
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from flotilla.client import Agent, AgentConfig, LocalTrainer
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import encode_state
from flotilla.core.timeouts import Timeouts
from flotilla.proto import PROTOCOL_VERSION
from flotilla.proto import flotilla_pb2 as pb
from flotilla.proto import flotilla_pb2_grpc as pb_grpc
from flotilla.server.federation import auth
from flotilla.tasks import Shard, ShardTraining
from tests.support.live_grpc import (
    DIGITS,
    QUICK_JOB,
    SPEC,
    Device,
    LiveServer,
    live_server,
    refused,
    run_cli,
    small_delta,
    update_messages,
)

pytestmark = pytest.mark.timeout(120)

UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture
async def live(db_url: str, tmp_path: Path) -> AsyncIterator[LiveServer]:
    """A live gRPC server on each database."""
    async with live_server(tmp_path / "state", db_url) as srv:
        yield srv


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


# --- credentials on every RPC ------------------------------------------------------------


def _bad_device_metadata(
    victim: Device, other: Device, operator_token: str, enrol_token: str
) -> dict[str, tuple[tuple[str, str], ...]]:
    """Ways to call as ``victim`` without its credential."""
    dev = ("x-flotilla-device", victim.device_id)
    return {
        "none": (),
        "no-device-id": (("authorization", f"Bearer {victim.credential}"),),
        "no-bearer": (dev,),
        "empty-bearer": (dev, ("authorization", "Bearer ")),
        "basic-scheme": (dev, ("authorization", f"Basic {victim.credential}")),
        "wrong-secret": (dev, ("authorization", f"Bearer {auth.new_secret()}")),
        "other-devices-secret": (dev, ("authorization", f"Bearer {other.credential}")),
        "credential-hash": (
            dev,
            ("authorization", f"Bearer {auth.hash_secret(victim.credential)}"),
        ),
        "unknown-device": (
            ("x-flotilla-device", "dev-000000000000"),
            ("authorization", f"Bearer {victim.credential}"),
        ),
        "operator-token": (dev, ("authorization", f"Bearer {operator_token}")),
        "enrol-token": (dev, ("authorization", f"Bearer {enrol_token}")),
    }


@dataclass
class Target:
    """The real round a thief would like to tamper with."""

    job_id: str
    task: pb.TrainTask
    update: list[pb.UpdateChunk]


def _agent_calls(live: LiveServer, t: Target) -> dict[str, Callable[[Any], Any]]:
    a = live.agent
    return {
        "Poll": lambda md: a.Poll(pb.PollRequest(), metadata=md, timeout=10),
        "Heartbeat": lambda md: a.Heartbeat(
            pb.HeartbeatRequest(round_token=t.task.round_token), metadata=md, timeout=10
        ),
        "FetchModel": lambda md: _drain(
            a.FetchModel(
                pb.FetchModelRequest(job_id=t.job_id, sha256=t.task.model_sha256),
                metadata=md,
                timeout=10,
            )
        ),
        "SubmitUpdate": lambda md: live.send_update(None, t.update, md),
        "SpeedTest": lambda md: live.stream_call(
            live.sync_agent.SpeedTest, [pb.SpeedChunk(data=bytes(1024))] * 4, md
        ),
        "Leave": lambda md: a.Leave(pb.LeaveRequest(reason="stolen"), metadata=md, timeout=10),
        "ReserveUpload": lambda md: a.ReserveUpload(
            pb.ReserveUploadRequest(
                job_id=t.job_id,
                round=t.task.round,
                round_token=t.task.round_token,
                payload_size=1024,
            ),
            metadata=md,
            timeout=10,
        ),
        "GiveUp": lambda md: a.GiveUp(
            pb.GiveUpRequest(
                job_id=t.job_id,
                round=t.task.round,
                round_token=t.task.round_token,
                reason="stolen",
            ),
            metadata=md,
            timeout=10,
        ),
        "ReportAverage": lambda md: a.ReportAverage(
            pb.AverageReport(
                job_id=t.job_id,
                round=t.task.round,
                round_token=t.task.round_token,
                model_sha256="ab" * 32,
                contributors=[pb.Participation(device_id="dev-x", num_samples=1)],
            ),
            metadata=md,
            timeout=10,
        ),
        "SecAgg": lambda md: a.SecAgg(
            pb.SecAggRequest(
                job_id=t.job_id,
                round=t.task.round,
                round_token=t.task.round_token,
                stage=1,
                body=b"FSA",
            ),
            metadata=md,
            timeout=10,
        ),
    }


def _operator_calls(
    live: LiveServer, job_id: str, victim_id: str = "dev-nope"
) -> dict[str, Callable[[Any], Any]]:
    o = live.operator
    spec = JobSpec.load(SPEC, [*QUICK_JOB, "job.name=intruder"]).to_json()
    return {
        "SubmitJob": lambda md: o.SubmitJob(
            pb.SubmitJobRequest(spec_json=spec), metadata=md, timeout=30
        ),
        "ListJobs": lambda md: o.ListJobs(pb.ListJobsRequest(), metadata=md, timeout=10),
        "GetJob": lambda md: o.GetJob(pb.GetJobRequest(job_id=job_id), metadata=md, timeout=10),
        "CancelJob": lambda md: o.CancelJob(
            pb.GetJobRequest(job_id=job_id), metadata=md, timeout=10
        ),
        "ExportModel": lambda md: _drain(
            o.ExportModel(pb.GetJobRequest(job_id=job_id), metadata=md, timeout=10)
        ),
        "ListDevices": lambda md: o.ListDevices(pb.ListDevicesRequest(), metadata=md, timeout=10),
        "ListVolunteerRuns": lambda md: o.ListVolunteerRuns(
            pb.ListVolunteerRunsRequest(), metadata=md, timeout=10
        ),
        "RevokeDevice": lambda md: o.RevokeDevice(
            pb.RevokeDeviceRequest(device_id=victim_id), metadata=md, timeout=10
        ),
        "ListRefusals": lambda md: o.ListRefusals(
            pb.ListRefusalsRequest(), metadata=md, timeout=10
        ),
    }


async def test_bad_credentials_are_refused_on_every_rpc_and_leave_no_trace(
    live: LiveServer,
) -> None:
    enrol_token = await live.enrol_token()
    victim = await live.enrol(enrol_token)
    other = await live.enrol(enrol_token)
    job_id = await live.submit()
    task = await live.poll_task(victim)
    model = await live.fetch(victim, task)
    await live.wait_state(job_id, "running")
    good = update_messages(task, encode_state(small_delta(model)))
    target = Target(job_id, task, good)
    before = await live.snapshot()
    assert len(before["devices"]) == 2 and len(before["jobs"]) == 1

    device_md = _bad_device_metadata(victim, other, live.operator_token, enrol_token)
    # Every call of both services is tried (Enrol is unauthenticated by design).
    services = pb.DESCRIPTOR.services_by_name
    assert set(_agent_calls(live, target)) == {m.name for m in services["Agent"].methods} - {
        "Enrol"
    }
    assert set(_operator_calls(live, job_id)) == {m.name for m in services["Operator"].methods}
    for rpc, call in _agent_calls(live, target).items():
        for variant, md in device_md.items():
            try:
                await refused(call(md), UNAUTHENTICATED, "device credentials")
            except AssertionError as exc:
                raise AssertionError(f"{rpc} with {variant} metadata: {exc}") from exc

    operator_md = {
        "none": (),
        "empty-bearer": (("authorization", "Bearer "),),
        "wrong-token": (("authorization", f"Bearer {auth.new_secret()}"),),
        "basic-scheme": (("authorization", f"Basic {live.operator_token}"),),
        "token-hash": (("authorization", f"Bearer {auth.hash_secret(live.operator_token)}"),),
        "enrol-token": (("authorization", f"Bearer {enrol_token}"),),
        "device-credential": (("authorization", f"Bearer {victim.credential}"),),
    }
    for rpc, call in _operator_calls(live, job_id, victim.device_id).items():
        for variant, md in operator_md.items():
            try:
                await refused(call(md), UNAUTHENTICATED, "operator token")
            except AssertionError as exc:
                raise AssertionError(f"{rpc} with {variant} metadata: {exc}") from exc

    assert await live.snapshot() == before, "refused calls changed the database"
    await live.assert_nothing_committed(job_id)
    # Neither the stolen Leave nor the stolen upload touched the victim's round.
    beat = await live.agent.Heartbeat(
        pb.HeartbeatRequest(round_token=task.round_token), metadata=victim.md, timeout=10
    )
    assert beat.round_open
    await live.good_update_commits(job_id, victim, task, model)
    assert (await live.get_job(job_id)).state == "running", "the stolen CancelJob did nothing"


async def test_refused_enrolment_creates_no_device(live: LiveServer) -> None:
    token = await live.enrol_token()
    before = await live.snapshot()
    profile = pb.DeviceProfile(tasks=[DIGITS])

    def enrol(version: int, secret: str) -> Any:
        request = pb.EnrolRequest(protocol_version=version, token=secret, profile=profile)
        return live.agent.Enrol(request, timeout=10)

    for secret in ("", auth.new_secret(), live.operator_token, auth.hash_secret(token), " "):
        await refused(enrol(PROTOCOL_VERSION, secret), UNAUTHENTICATED, "enrolment token")
    for version in (0, PROTOCOL_VERSION + 1, 2**32 - 1):
        details = await refused(enrol(version, token), grpc.StatusCode.FAILED_PRECONDITION)
        assert f"protocol version {version}" in details and str(PROTOCOL_VERSION) in details
    assert await live.snapshot() == before
    assert await live.store.list_devices() == []

    device = await live.enrol(token)
    assert [d.id for d in await live.store.list_devices()] == [device.device_id]


async def test_cli_client_with_a_wrong_token_exits_quickly(tmp_path: Path) -> None:
    async with live_server(tmp_path / "state") as live:
        result = await run_cli(
            "client",
            "--server", f"127.0.0.1:{live.port}",
            "--token", "WRONG",
            "--task", DIGITS,
            "--shard", "0/1",
            timeout=30,
        )  # fmt: skip
        err = result.stderr
        assert result.returncode != 0, result
        assert result.seconds < 30
        assert "token" in err and "refused" in err, err
        assert "Traceback" not in err, err
        assert await live.store.list_devices() == []


async def test_token_create_cli_mints_a_token_that_enrols(live: LiveServer) -> None:
    # No --db: the command finds the server's database through its state directory.
    result = await run_cli("server", "token", "create", "--state-dir", str(live.server.state_dir))
    assert result.returncode == 0, result
    token = result.stdout.strip().splitlines()[-1]
    assert len(token) >= 32 and " " not in token
    device = await live.enrol(token)
    assert device.device_id.startswith("dev-")
    assert [d.id for d in await live.store.list_devices()] == [device.device_id]


async def test_operator_token_file_is_private(tmp_path: Path) -> None:
    async with live_server(tmp_path / "state") as live:
        path = live.server.state_dir / auth.OPERATOR_TOKEN_FILE
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert await live.operator.ListJobs(pb.ListJobsRequest(), metadata=live.op_md, timeout=10)
    # A restart keeps the same token, and the file stays private.
    async with live_server(tmp_path / "state") as again:
        assert again.operator_token == live.operator_token
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


# --- TLS ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    cert: Path
    key: Path
    ca: Path
    other_ca: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _ca(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A CA, a server certificate it signs for localhost and 127.0.0.1, and a stranger CA."""
    out = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert = _ca("flotilla test CA")
    _, other_cert = _ca("some other CA")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    pki = Pki(out / "server.pem", out / "server.key", out / "ca.pem", out / "other-ca.pem")
    pki.cert.write_bytes(_pem(cert))
    pki.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    os.chmod(pki.key, 0o600)
    pki.ca.write_bytes(_pem(ca_cert))
    pki.other_ca.write_bytes(_pem(other_cert))
    return pki


@pytest.fixture
async def tls_live(tmp_path: Path, pki: Pki) -> AsyncIterator[LiveServer]:
    async with live_server(tmp_path / "state", tls=(pki.cert, pki.key, pki.ca)) as srv:
        yield srv


async def test_agent_completes_a_round_over_tls(
    tls_live: LiveServer, tmp_path: Path, pki: Pki
) -> None:
    live = tls_live
    config = AgentConfig(
        server=f"localhost:{live.port}",
        token=await live.enrol_token(),
        trainer=LocalTrainer(ShardTraining(DIGITS, Shard(0, 1))),
        state_dir=tmp_path / "agent",
        tls_ca=pki.ca,
        timeouts=Timeouts(heartbeat_every_s=1.0),
        speed_test_bytes=64 * 1024,
    )
    agent = Agent(config)
    running = asyncio.ensure_future(agent.run())
    try:
        job_id = await live.submit("job.rounds=1")
        deadline = time.monotonic() + 60
        while (job := await live.get_job(job_id, with_rounds=True)).state != "completed":
            if running.done():
                raise AssertionError(f"the agent stopped: {running.exception()!r}")
            assert time.monotonic() < deadline, f"job not completed over TLS: {job}"
            await asyncio.sleep(0.2)
        assert job.rounds_committed == 1
        assert list(job.rounds[0].participants) == [agent.device_id]
        assert agent.device_id is not None
        assert agent.rounds_done == 1
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    assert stat.S_IMODE((tmp_path / "agent" / "credential.json").stat().st_mode) == 0o600


async def test_plaintext_client_cannot_talk_to_the_tls_port(tls_live: LiveServer) -> None:
    live = tls_live
    token = await live.enrol_token()
    request = pb.EnrolRequest(
        protocol_version=PROTOCOL_VERSION, token=token, profile=pb.DeviceProfile(tasks=[DIGITS])
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{live.port}") as channel:
        await refused(
            pb_grpc.AgentStub(channel).Enrol(request, timeout=10), grpc.StatusCode.UNAVAILABLE
        )
        call = pb_grpc.OperatorStub(channel).ListJobs(
            pb.ListJobsRequest(), metadata=live.op_md, timeout=10
        )
        await refused(call, grpc.StatusCode.UNAVAILABLE)
    assert await live.store.list_devices() == []
    # The TLS port itself works for a client that trusts the right CA.
    assert (await live.enrol(token)).device_id.startswith("dev-")


async def test_client_trusting_another_ca_cannot_connect(tls_live: LiveServer, pki: Pki) -> None:
    live = tls_live
    token = await live.enrol_token()
    request = pb.EnrolRequest(
        protocol_version=PROTOCOL_VERSION, token=token, profile=pb.DeviceProfile(tasks=[DIGITS])
    )
    creds = grpc.ssl_channel_credentials(root_certificates=pki.other_ca.read_bytes())
    for host in ("localhost", "127.0.0.1"):
        async with grpc.aio.secure_channel(f"{host}:{live.port}", creds) as channel:
            call = pb_grpc.AgentStub(channel).Enrol(request, timeout=10)
            await refused(call, grpc.StatusCode.UNAVAILABLE)
    assert await live.store.list_devices() == []


def test_secrets_never_start_with_a_dash() -> None:
    """``--token -abc`` would be read as an option: every token must be a safe argument."""
    from flotilla.server.federation.auth import new_secret

    secrets = [new_secret() for _ in range(2000)]  # ~31 would start with "-" by chance
    assert not [s for s in secrets if s.startswith("-")]
    assert len(set(secrets)) == len(secrets) and all(len(s) >= 43 for s in secrets)
