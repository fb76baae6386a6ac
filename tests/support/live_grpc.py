"""A federation server in the test's own event loop, and a raw gRPC client to poke it with.

The client is deliberately low level: it speaks the wire protocol message by message, so a
test can send exactly what a buggy or hostile agent would. Shared by test_bad_input.py and
test_auth_tls.py.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import create_async_engine

from flotilla.core.blobs import BlobAssembler, iter_chunks, sha256_hex
from flotilla.core.identity import DeviceIdentity
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import ModelState, decode_state, encode_state
from flotilla.core.timeouts import Timeouts
from flotilla.engine import EngineConfig
from flotilla.proto import PROTOCOL_VERSION
from flotilla.proto import flotilla_pb2 as pb
from flotilla.proto import flotilla_pb2_grpc as pb_grpc
from flotilla.server.app import FederationServer, ServerConfig
from flotilla.server.federation import auth
from flotilla.server.federation.schema import Base
from flotilla.server.federation.store import Store, async_url
from tests.support.lifetime import bound

DIGITS = "flotilla.tasks.digits:DigitsTask"
SPEC = Path(__file__).resolve().parents[2] / "examples" / "digits.toml"
# Lease expiry times: a running server moves them forward on its own clock, whatever a
# device sends, so a snapshot meant to show "nothing changed" leaves them out.
_RENEWED = frozenset({("servers", "expires_at"), ("job_leases", "expires_at")})
#: What a quick test job looks like: one device per round, rounds that wait long enough
#: for a test to send a few bad updates before the good one.
QUICK_JOB = (
    "job.rounds=2",
    "job.clients_per_round=1",
    "job.min_quorum=1",
    "job.round_deadline_s=30",
    "job.name=quick",
)
#: The test client may send far more than the server accepts, to prove the server refuses.
CLIENT_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),
]
RPC_TIMEOUT = 15.0


@dataclass(frozen=True)
class Device:
    device_id: str
    credential: str
    #: The key registered at enrolment; ``send_update`` signs each header with it.
    identity: DeviceIdentity = field(default_factory=DeviceIdentity.generate, compare=False)

    @property
    def md(self) -> tuple[tuple[str, str], ...]:
        return (
            ("x-flotilla-device", self.device_id),
            ("authorization", f"Bearer {self.credential}"),
        )


async def refused(call: Awaitable[Any], code: grpc.StatusCode, *needles: str) -> str:
    """Await ``call``: it must fail with ``code`` and details containing every needle."""
    with pytest.raises(grpc.RpcError) as info:
        await call
    err: Any = info.value  # an AioRpcError or the sync client's error; both are grpc.Call
    details = err.details() or ""
    assert err.code() == code, f"{err.code().name}: {details}"
    for needle in needles:
        assert needle.lower() in details.lower(), f"{needle!r} not in {details!r}"
    return str(details)


@dataclass(frozen=True)
class CliResult:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


async def run_cli(*args: str, timeout: float = 60.0) -> CliResult:
    """``python -m flotilla ARGS`` without blocking this loop, which serves the server."""
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *bound([sys.executable, "-m", "flotilla", *args]),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"flotilla {' '.join(args)} still running after {timeout}s") from None
    assert proc.returncode is not None
    return CliResult(proc.returncode, out.decode(), err.decode(), time.monotonic() - started)


def small_delta(model: ModelState, value: float = 1e-3) -> ModelState:
    """A well-formed update: every tensor the model's shape and dtype, small finite values."""
    return {name: np.full(arr.shape, value, dtype=arr.dtype) for name, arr in model.items()}


def update_messages(
    task: pb.TrainTask, payload: bytes, chunk_bytes: int = 64 * 1024, **header: Any
) -> list[pb.UpdateChunk]:
    """Header then payload chunks, exactly as an honest agent sends them; ``header`` overrides."""
    return [update_header(task, payload, **header), *data_messages(payload, chunk_bytes)]


def update_header(task: pb.TrainTask, payload: bytes, **overrides: Any) -> pb.UpdateChunk:
    fields: dict[str, Any] = {
        "job_id": task.job_id,
        "round": task.round,
        "round_token": task.round_token,
        "num_samples": 42,
        "metrics": {"accuracy": 0.5},
        "payload_size": len(payload),
        "payload_sha256": sha256_hex(payload),
        "codec": "safetensors",
    }
    fields.update(overrides)
    return pb.UpdateChunk(header=pb.UpdateHeader(**fields))


def signed(message: pb.UpdateChunk, identity: DeviceIdentity) -> pb.UpdateChunk:
    """``message`` (a header without a signature) signed by ``identity``; else as it is."""
    if not message.HasField("header") or message.header.signature:
        return message
    h = message.header
    try:
        digest = bytes.fromhex(h.payload_sha256)
        signature = identity.sign_update(h.job_id, h.round, h.round_token, digest)
    except ValueError:  # a deliberately malformed header: refused before its signature
        return message
    out = pb.UpdateChunk()
    out.CopyFrom(message)
    out.header.nonce, out.header.signature = signature.nonce, signature.signature
    return out


def data_messages(payload: bytes, chunk_bytes: int = 64 * 1024) -> list[pb.UpdateChunk]:
    return [pb.UpdateChunk(data=bytes(p)) for p in iter_chunks(payload, chunk_bytes)]


class LiveServer:
    """A started :class:`FederationServer` plus stubs on a plaintext or TLS channel.

    Client-streaming calls go through a synchronous channel in a worker thread: when a
    server refuses such a call before the client has sent everything (as it must for a bad
    credential or header), grpc.aio's client may report INTERNAL "Failed execute_batch"
    instead of the server's status (grpc/grpc#36066). The sync client reports it faithfully.
    """

    def __init__(
        self, server: FederationServer, channel: grpc.aio.Channel, sync_channel: grpc.Channel
    ) -> None:
        self.server = server
        self.channel = channel
        self.sync_channel = sync_channel
        self.agent = pb_grpc.AgentStub(channel)
        self.operator = pb_grpc.OperatorStub(channel)
        self.sync_agent = pb_grpc.AgentStub(sync_channel)
        self.operator_token = (server.state_dir / auth.OPERATOR_TOKEN_FILE).read_text().strip()
        self._engine = create_async_engine(async_url(server.db_url))

    @property
    def store(self) -> Store:
        return self.server.store

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def op_md(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.operator_token}"),)

    async def close(self) -> None:
        await self._engine.dispose()
        await self.channel.close(None)
        self.sync_channel.close()

    # --- database ------------------------------------------------------------------------

    async def snapshot(self) -> dict[str, list[tuple[Any, ...]]]:
        """Every row of every table, read through a connection of our own; but for
        ``refusals``, the record a refused update is meant to leave (docs/identity.md), and
        the lease expiry times the server renews on its own clock (docs/deploy.md)."""
        out: dict[str, list[tuple[Any, ...]]] = {}
        async with self._engine.connect() as conn:
            for table in Base.metadata.sorted_tables:
                if table.name == "refusals":
                    continue
                columns = [c for c in table.columns if (table.name, c.name) not in _RENEWED]
                query = select(*columns).order_by(*table.primary_key.columns)
                out[table.name] = [tuple(r) for r in await conn.execute(query)]
        return out

    async def row_counts(self) -> dict[str, int]:
        return {name: len(rows) for name, rows in (await self.snapshot()).items()}

    # --- enrolment -----------------------------------------------------------------------

    async def enrol_token(self) -> str:
        token = auth.new_secret()
        await self.store.add_enrol_token(auth.hash_secret(token))
        return token

    async def enrol(self, token: str | None = None, tasks: Sequence[str] = (DIGITS,)) -> Device:
        identity = DeviceIdentity.generate()
        reply = await self.agent.Enrol(
            pb.EnrolRequest(
                protocol_version=PROTOCOL_VERSION,
                token=token or await self.enrol_token(),
                profile=pb.DeviceProfile(tasks=list(tasks)),
                public_key=identity.public_key_hex,
            ),
            timeout=RPC_TIMEOUT,
        )
        return Device(reply.device_id, reply.credential, identity)

    # --- jobs ----------------------------------------------------------------------------

    async def submit(self, *overrides: str) -> str:
        spec = JobSpec.load(SPEC, [*QUICK_JOB, *overrides])
        info = await self.operator.SubmitJob(
            pb.SubmitJobRequest(spec_json=spec.to_json()), metadata=self.op_md, timeout=60
        )
        return info.id

    async def get_job(self, job_id: str, with_rounds: bool = False) -> pb.JobInfo:
        return await self.operator.GetJob(
            pb.GetJobRequest(job_id=job_id, with_rounds=with_rounds),
            metadata=self.op_md,
            timeout=RPC_TIMEOUT,
        )

    async def wait_committed(self, job_id: str, rounds: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            job = await self.store.get_job(job_id)
            assert job is not None
            if job.rounds_committed >= rounds:
                return
            assert time.monotonic() < deadline, f"round {rounds} of {job_id} never committed"
            await asyncio.sleep(0.05)

    async def wait_state(self, job_id: str, state: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while (job := await self.store.get_job(job_id)) is None or job.state != state:
            assert time.monotonic() < deadline, f"job {job_id} never became {state}: {job}"
            await asyncio.sleep(0.05)

    async def assert_nothing_committed(self, job_id: str) -> None:
        """No round of the job is committed, by the store and by the operator API."""
        job = await self.store.get_job(job_id)
        assert job is not None and job.rounds_committed == 0, job
        assert await self.store.list_participations(job_id) == []
        assert await self.store.list_rounds(job_id) == []
        info = await self.get_job(job_id, with_rounds=True)
        assert info.rounds_committed == 0 and len(info.rounds) == 0, info

    # --- the agent protocol --------------------------------------------------------------

    async def poll_task(
        self, device: Device, timeout: float = 20.0, p2p_peer_id: str = ""
    ) -> pb.TrainTask:
        deadline = time.monotonic() + timeout
        request = pb.PollRequest(p2p_peer_id=p2p_peer_id)
        while time.monotonic() < deadline:
            reply = await self.agent.Poll(request, metadata=device.md, timeout=30)
            if reply.HasField("task"):
                return reply.task
        raise AssertionError(f"{device.device_id} was never given a task")

    async def fetch(self, device: Device, task: pb.TrainTask) -> ModelState:
        assembler = BlobAssembler(task.model_size, task.model_sha256, 2**30)
        call = self.agent.FetchModel(
            pb.FetchModelRequest(job_id=task.job_id, sha256=task.model_sha256),
            metadata=device.md,
            timeout=RPC_TIMEOUT,
        )
        async for chunk in call:
            assembler.add(chunk.data, chunk.offset)
        return decode_state(bytes(assembler.finish()))

    async def send_update(
        self,
        device: Device | None,
        messages: Iterable[pb.UpdateChunk],
        metadata: Sequence[tuple[str, str]] | None = None,
    ) -> pb.SubmitReply:
        """SubmitUpdate with ``device``'s credential, or with ``metadata`` as given; an
        unsigned header is signed with ``device``'s key (as an honest agent signs it)."""
        md = tuple(metadata if metadata is not None else device.md if device else ())
        sent = [signed(m, device.identity) if device else m for m in messages]
        return await self.stream_call(self.sync_agent.SubmitUpdate, sent, md)

    async def stream_call(
        self, method: Any, messages: Iterable[Any], metadata: Sequence[tuple[str, str]]
    ) -> Any:
        """A client-streaming call on the sync channel, off this loop (see the class doc)."""
        return await asyncio.to_thread(
            method, iter(messages), metadata=tuple(metadata), timeout=RPC_TIMEOUT
        )

    async def good_update_commits(
        self, job_id: str, device: Device, task: pb.TrainTask, model: ModelState
    ) -> None:
        """An honest update for the round is accepted, and the round commits with only it."""
        before = await self.store.get_job(job_id)
        assert before is not None
        reply = await self.send_update(
            device, update_messages(task, encode_state(small_delta(model)))
        )
        assert reply.accepted, reply
        await self.wait_committed(job_id, task.round)
        rows = await self.store.list_participations(job_id)
        mine = [(p.round, p.device_id) for p in rows if p.round == task.round]
        assert mine == [(task.round, device.device_id)], rows
        assert rows[-1].num_samples == 42
        job = await self.store.get_job(job_id)
        assert job is not None and job.rounds_committed == task.round
        assert job.checkpoint_sha256 != task.model_sha256, "the update moved the model"
        info = await self.get_job(job_id, with_rounds=True)
        assert list(info.rounds[task.round - 1].participants) == [device.device_id]


@asynccontextmanager
async def live_server(
    state_dir: Path,
    db_url: str | None = None,
    *,
    tls: tuple[Path, Path, Path] | None = None,
    **config: Any,
) -> AsyncIterator[LiveServer]:
    """Start a server on 127.0.0.1:0 in this event loop; ``tls`` is (cert, key, ca)."""
    if db_url is not None and db_url.startswith("postgresql"):
        store = await Store.open(db_url)  # a shared PostgreSQL database: start empty
        try:
            await store.wipe()
        finally:
            await store.close()
    config.setdefault("timeouts", Timeouts(liveness_s=30.0, poll_hold_s=5.0))
    config.setdefault("engine", EngineConfig(selection_grace_s=0.2))
    config.setdefault("http_port", None)  # the HTTP edge's tests ask for it (port 0)
    server = FederationServer(
        ServerConfig(
            host="127.0.0.1",
            port=0,
            state_dir=state_dir,
            db_url=db_url,
            tls_cert=tls[0] if tls else None,
            tls_key=tls[1] if tls else None,
            **config,
        )
    )
    port = await server.start()
    if tls:
        creds = grpc.ssl_channel_credentials(root_certificates=tls[2].read_bytes())
        channel = grpc.aio.secure_channel(f"localhost:{port}", creds, options=CLIENT_OPTIONS)
        sync_channel = grpc.secure_channel(f"127.0.0.1:{port}", creds, options=CLIENT_OPTIONS)
    else:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CLIENT_OPTIONS)
        sync_channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CLIENT_OPTIONS)
    live = LiveServer(server, channel, sync_channel)
    try:
        yield live
    finally:
        await live.close()
        await server.stop(grace_s=0.2)
