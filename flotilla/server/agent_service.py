"""gRPC handlers for agents: enrol, poll, heartbeat, fetch model, submit update, leave."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from flotilla.compression import Codec, NoneCodec, decode_state_with, max_payload_bytes
from flotilla.core.allreduce import Contribution
from flotilla.core.blobs import BlobAssembler
from flotilla.core.device import DeviceProfile
from flotilla.core.errors import AuthError, StaleRoundError, UpdateRejected, WireError
from flotilla.core.records import DeviceRecord
from flotilla.core.tensors import (
    ModelState,
    TensorSpec,
    check_finite,
    decode_state,
    read_metadata,
)
from flotilla.core.update import Update
from flotilla.engine.backend import Reported, TrainTask
from flotilla.proto import PROTOCOL_VERSION
from flotilla.proto import flotilla_pb2 as pb
from flotilla.proto import flotilla_pb2_grpc as pb_grpc
from flotilla.proto.bulk import UpdatePart
from flotilla.server.federation.budget import ByteBudget

if TYPE_CHECKING:
    from flotilla.server.app import FederationServer

log = logging.getLogger(__name__)

#: Room for a safetensors header beyond the raw tensor bytes of an update.
HEADER_SLACK = 1024 * 1024
#: Seconds past a round's deadline that an upload already under way may still finish in.
UPLOAD_GRACE_S = 5.0
#: Most members a server-less round's report may name.
MAX_GROUP = 4096
#: Header codec names that mean plain safetensors of the delta.
PLAIN_CODECS = {"": "none", "safetensors": "none"}


def decode_update(
    payload: memoryview, layout: tuple[TensorSpec, ...], codec: Codec, limit: int
) -> ModelState:
    """The delta in ``layout``, from plain safetensors or the job's codec payload.

    Plain safetensors (no codec metadata) is always accepted for ``none``: it is what any
    client in any language can write, and it decodes without a copy.
    """
    if codec.name == "none" and "codec" not in read_metadata(payload, limit):
        return decode_state(payload, expected=layout, max_bytes=limit)
    return decode_state_with(payload, layout, limit, codec=codec)


def profile_from_pb(device_id: str, msg: pb.DeviceProfile) -> DeviceProfile:
    return DeviceProfile(
        device_id=device_id,
        tasks=tuple(msg.tasks),
        gflops=msg.gflops,
        memory_bytes=msg.memory_bytes,
        upload_bytes_per_s=msg.upload_bytes_per_s,
    )


def report_from_pb(device_id: str, msg: pb.AverageReport) -> Reported:
    """A device's report, checked for shape (the engine checks who it names)."""
    sha = msg.model_sha256
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise WireError("model_sha256 must be 64 lowercase hex digits")
    if not 0 < len(msg.contributors) <= MAX_GROUP:
        raise WireError(f"a report names 1 to {MAX_GROUP} contributors")
    contributors = tuple(
        Contribution.from_dict(
            {"device_id": c.device_id, "num_samples": c.num_samples, "metrics": dict(c.metrics)}
        )
        for c in msg.contributors
    )
    seconds = msg.allreduce_seconds
    return Reported(
        device_id=device_id,
        elapsed_s=0.0,
        model_sha256=sha,
        group_id=msg.group_id[:128],
        contributors=contributors,
        allreduce_s=seconds if math.isfinite(seconds) and seconds >= 0 else 0.0,
        reverted=int(msg.reverted),
    )


class KeyedLock:
    """One asyncio lock per key, dropped when nobody holds or awaits it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


def update_limit(task: TrainTask) -> int:
    """Largest payload a device may send for ``task``: checked before any buffer exists."""
    return max(
        sum(s.nbytes for s in task.layout) + HEADER_SLACK,
        max_payload_bytes(task.codec, task.layout),
    )


@dataclass(slots=True)
class _Held:
    device_id: str
    round_token: str
    size: int
    taken: int
    expiry: asyncio.TimerHandle


class Reservations:
    """Room in the upload budget, granted before an upload starts and held briefly.

    A device waits for room in a cheap unary call instead of with an upload stream open,
    where gRPC would keep reading its data ahead into buffers. Room not used within
    ``ttl_s`` goes back to the budget; a device holds at most one reservation.
    """

    def __init__(self, budget: ByteBudget, ttl_s: float) -> None:
        self._budget = budget
        self.ttl_s = ttl_s
        self._held: dict[str, _Held] = {}
        self._returns: set[asyncio.Task[None]] = set()

    async def make(self, device_id: str, request: pb.ReserveUploadRequest) -> str:
        for key in [k for k, h in self._held.items() if h.device_id == device_id]:
            self._give_back(key)
        taken = await self._budget.acquire(request.payload_size)
        key = secrets.token_hex(16)
        expiry = asyncio.get_running_loop().call_later(self.ttl_s, self._give_back, key)
        self._held[key] = _Held(device_id, request.round_token, request.payload_size, taken, expiry)
        return key

    @contextlib.asynccontextmanager
    async def claim(self, key: str, device_id: str, head: pb.UpdateHeader) -> AsyncIterator[None]:
        held = self._held.pop(key, None)
        if held is None or held.device_id != device_id:
            raise WireError("unknown or expired upload reservation; reserve again")
        held.expiry.cancel()
        try:
            if held.round_token != head.round_token or head.payload_size > held.size:
                raise WireError("the upload does not match its reservation")
            yield
        finally:
            await self._budget.release(held.taken)

    def _give_back(self, key: str) -> None:
        held = self._held.pop(key, None)
        if held is None:
            return
        held.expiry.cancel()
        task = asyncio.ensure_future(self._budget.release(held.taken))
        self._returns.add(task)
        task.add_done_callback(self._returns.discard)


class AgentService(pb_grpc.AgentServicer):
    def __init__(self, server: FederationServer) -> None:
        self.server = server
        self._uploads = KeyedLock()
        self._reservations = Reservations(server.upload_budget, server.config.timeouts.upload_idle)

    async def _device(self, context: grpc.aio.ServicerContext) -> DeviceRecord:
        try:
            return await self.server.authenticate_device(context.invocation_metadata())
        except AuthError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            raise  # unreachable: abort raises

    async def Enrol(
        self, request: pb.EnrolRequest, context: grpc.aio.ServicerContext
    ) -> pb.EnrolReply:
        if request.protocol_version != PROTOCOL_VERSION:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {request.protocol_version} not supported; "
                f"this server speaks {PROTOCOL_VERSION}",
            )
        try:
            device_id, credential = await self.server.enrol(request.token, request.profile)
        except AuthError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        return pb.EnrolReply(
            device_id=device_id, credential=credential, protocol_version=PROTOCOL_VERSION
        )

    async def SpeedTest(
        self, request_iterator: AsyncIterator[pb.SpeedChunk], context: grpc.aio.ServicerContext
    ) -> pb.SpeedReply:
        await self._device(context)
        start = time.perf_counter()
        total = 0
        async for chunk in request_iterator:
            total += len(chunk.data)
            if total > self.server.config.speed_test_max_bytes:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "speed test too long")
        return pb.SpeedReply(bytes=total, seconds=time.perf_counter() - start)

    async def Poll(
        self, request: pb.PollRequest, context: grpc.aio.ServicerContext
    ) -> pb.PollReply:
        device = await self._device(context)
        profile = request.profile if request.HasField("profile") else None
        if request.p2p_peer_id:
            try:
                self.server.rendezvous.peer_seen(device.id, request.p2p_peer_id)
            except WireError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        await self.server.device_seen(device, profile)
        timeouts = self.server.config.timeouts
        # A held poll is a live device: hold it for less than the liveness window, so the
        # reaper never drops an agent that is simply waiting for work.
        hold = min(timeouts.poll_hold, timeouts.liveness / 2)
        task = await self.server.gateway.poll(device.id, hold)
        if task is None:
            return pb.PollReply()
        return pb.PollReply(
            task=pb.TrainTask(
                job_id=task.job_id,
                round=task.round,
                round_token=task.round_token,
                task=task.task,
                config_json=task.config_json,
                model_sha256=task.model_sha256,
                model_size=task.model_size,
                deadline_unix=task.deadline,
                seed=task.seed,
                delta_base_sha256=task.delta_base_sha256,
                delta_sha256=task.delta_sha256,
                delta_size=task.delta_size,
            )
        )

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatReply:
        device = await self._device(context)
        self.server.pool.touch(device.id)
        return pb.HeartbeatReply(round_open=self.server.gateway.round_open(request.round_token))

    async def FetchModel(
        self, request: pb.FetchModelRequest, context: grpc.aio.ServicerContext
    ) -> None:
        device = await self._device(context)
        if not self.server.gateway.assigned_model(device.id, request.sha256):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "stale round: that model is not assigned to this device",
            )
        idle = self.server.config.timeouts.upload_idle
        gateway = self.server.gateway
        async with contextlib.aclosing(self.server.stream_blob(request.sha256)) as chunks:
            async for message, size in chunks:
                gateway.count_download(device.id, request.sha256, size)
                try:
                    # A reader that stops reading must not hold a download slot forever.
                    await asyncio.wait_for(context.write(message), idle)
                except asyncio.TimeoutError:
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED, f"download stalled for {idle:.0f}s"
                    )
                self.server.pool.touch(device.id)  # a long download is a sign of life

    async def SubmitUpdate(
        self, request_iterator: AsyncIterator[UpdatePart], context: grpc.aio.ServicerContext
    ) -> pb.SubmitReply:
        device = await self._device(context)
        try:
            # One upload per device at a time: a device opening many streams at once would
            # otherwise get a model-sized buffer for each.
            async with self._uploads.hold(device.id):
                await self._receive(device, request_iterator)
        except StaleRoundError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except (WireError, UpdateRejected) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.SubmitReply(accepted=True, detail="aggregated")

    async def _receive(self, device: DeviceRecord, chunks: AsyncIterator[UpdatePart]) -> None:
        try:
            first = await asyncio.wait_for(
                anext(aiter(chunks), None), self.server.config.timeouts.upload_idle
            )
        except asyncio.TimeoutError:
            raise WireError("no update header arrived") from None
        if first is None or first.header is None:
            raise WireError("the first message of an update must be its header")
        head = first.header
        gateway = self.server.gateway
        rnd = gateway.expect(device.id, head.job_id, head.round, head.round_token)
        codec = rnd.task.codec
        if rnd.task.transport == "p2p":
            gateway.expect_upload(rnd, device.id)
            codec = NoneCodec()  # the group's exact average, as the devices applied it
        sent = PLAIN_CODECS.get(head.codec, head.codec)
        if sent != codec.name:
            raise WireError(
                f"update codec {head.codec!r}; this job's uplink codec is {codec.name!r}"
            )
        if head.num_samples <= 0:
            raise UpdateRejected("num_samples must be positive")
        limit = update_limit(rnd.task)
        if not 0 <= head.payload_size <= limit:
            raise WireError(f"update of {head.payload_size} bytes exceeds the limit of {limit}")
        # The buffer is allocated only once the byte budget admits it (ahead of the stream,
        # with ReserveUpload, or here), so memory is bounded however many devices upload at
        # once; a sender that stalls is dropped.
        room: contextlib.AbstractAsyncContextManager[object]
        if head.reservation:
            room = self._reservations.claim(head.reservation, device.id, head)
        else:
            room = self.server.upload_budget.hold(head.payload_size)
        async with room:
            assembler = BlobAssembler(head.payload_size, head.payload_sha256, limit)
            try:
                payload = await asyncio.wait_for(
                    self._read(chunks, assembler, device.id), self._time_left(rnd.task.deadline)
                )
            except asyncio.TimeoutError:
                raise StaleRoundError(
                    "stale round: the round closed before this update finished uploading"
                ) from None
            delta = decode_update(payload, rnd.task.layout, codec, limit)
            # Refuse here, before delivery: a refusal from the engine would cost the device
            # its place in the round, so it could not send a corrected update.
            check_finite(delta)
            update = Update(
                job_id=head.job_id,
                round=head.round,
                device_id=device.id,
                num_samples=int(head.num_samples),
                delta=delta,
                metrics={
                    **head.metrics,
                    # Measured here, not reported: what this device cost the network.
                    "bytes_up": float(head.payload_size),
                    "bytes_down": float(rnd.bytes_down.get(device.id, 0)),
                },
            )
            await gateway.deliver(rnd, update, self._time_left(rnd.task.deadline))

    async def ReserveUpload(
        self, request: pb.ReserveUploadRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReserveUploadReply:
        device = await self._device(context)
        try:
            rnd = self.server.gateway.expect(
                device.id, request.job_id, request.round, request.round_token
            )
            limit = update_limit(rnd.task)
            if not 0 <= request.payload_size <= limit:
                raise WireError(
                    f"update of {request.payload_size} bytes exceeds the limit of {limit}"
                )
            reservation = await asyncio.wait_for(
                self._reservations.make(device.id, request),
                self._time_left(rnd.task.deadline),
            )
        except asyncio.TimeoutError:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "stale round: the round closes before there is room for this update",
            )
        except StaleRoundError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except WireError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.ReserveUploadReply(reservation=reservation, expires_in_s=self._reservations.ttl_s)

    async def _read(
        self, chunks: AsyncIterator[UpdatePart], assembler: BlobAssembler, device_id: str
    ) -> memoryview:
        idle = self.server.config.timeouts.upload_idle
        stream = aiter(chunks)
        while True:
            try:
                msg = await asyncio.wait_for(anext(stream, None), idle)
            except asyncio.TimeoutError:
                raise WireError(f"upload stalled: no data for {idle:.0f}s") from None
            if msg is None:
                return assembler.finish()
            if msg.data is None:
                raise WireError("an update carries exactly one header")
            assembler.add(msg.data)
            self.server.pool.touch(device_id)

    @staticmethod
    def _time_left(deadline: float) -> float:
        """Seconds an upload may still take: to the round's deadline, plus a little grace."""
        return max(1.0, deadline - time.time() + UPLOAD_GRACE_S)

    async def ReportAverage(
        self, request: pb.AverageReport, context: grpc.aio.ServicerContext
    ) -> pb.AverageReportReply:
        device = await self._device(context)
        gateway = self.server.gateway
        try:
            rnd = gateway.expect(device.id, request.job_id, request.round, request.round_token)
            if rnd.task.transport != "p2p":
                raise WireError("only server-less (p2p) rounds report; this one takes uploads")
            report = report_from_pb(device.id, request)
            upload = gateway.report(rnd, report)
            if not upload:
                hold = self.server.config.timeouts.report_hold
                upload = await gateway.hold_reporter(rnd, device.id, hold)
        except StaleRoundError:
            return pb.AverageReportReply(upload=False, round_open=False)
        except (WireError, UpdateRejected) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.server.pool.touch(device.id)
        open_ = gateway.round_open(request.round_token)
        return pb.AverageReportReply(upload=upload, round_open=open_)

    async def Leave(
        self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext
    ) -> pb.LeaveReply:
        device = await self._device(context)
        self.server.gateway.leave(device.id, request.reason or "no reason given")
        log.info("device %s left (%s)", device.id, request.reason)
        return pb.LeaveReply()
