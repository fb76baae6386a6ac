"""The Agent service: pb in, the federation's call, pb out. Errors map in ``status``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc

from flotilla.core.errors import WireError
from flotilla.core.records import DeviceRecord
from flotilla.proto import PROTOCOL_VERSION
from flotilla.proto import flotilla_pb2 as pb
from flotilla.proto.bulk import UpdatePart
from flotilla.server.federation.facade import Federation
from flotilla.server.grpc import wire
from flotilla.server.grpc.limits import peer_address
from flotilla.server.grpc.status import Context, Refusal


class AgentServicer:
    """Handlers for devices; ``idle_s`` bounds a stalled stream, ``speed_test_max_bytes``
    the bytes a speed test may send."""

    def __init__(self, federation: Federation, idle_s: float, speed_test_max_bytes: int) -> None:
        self._federation = federation
        self._idle_s = idle_s
        self._speed_test_max_bytes = speed_test_max_bytes

    async def _device(self, context: Context) -> DeviceRecord:
        device_id, secret = wire.device_credentials(context.invocation_metadata())
        cert = wire.peer_certificate(context.auth_context())
        return await self._federation.authenticate_device(device_id, secret, cert)

    async def Enrol(self, request: pb.EnrolRequest, context: Context) -> pb.EnrolReply:
        if request.protocol_version != PROTOCOL_VERSION:
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {request.protocol_version} not supported; "
                f"this server speaks {PROTOCOL_VERSION}",
            )
        enrolment = await self._federation.enrol(
            request.token,
            wire.profile_from_pb(request.profile),
            request.public_key,
            cert=wire.peer_certificate(context.auth_context()),
            address=peer_address(context.peer()),
        )
        return pb.EnrolReply(
            device_id=enrolment.device_id,
            credential=enrolment.secret,
            protocol_version=PROTOCOL_VERSION,
        )

    async def SpeedTest(
        self, request_iterator: AsyncIterator[pb.SpeedChunk], context: Context
    ) -> pb.SpeedReply:
        await self._device(context)
        start = time.perf_counter()
        total = 0
        async for chunk in request_iterator:
            total += len(chunk.data)
            if total > self._speed_test_max_bytes:
                raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "speed test too long")
        return pb.SpeedReply(bytes=total, seconds=time.perf_counter() - start)

    async def Poll(self, request: pb.PollRequest, context: Context) -> pb.PollReply:
        device = await self._device(context)
        profile = wire.profile_from_pb(request.profile) if request.HasField("profile") else None
        conditions = wire.conditions_of(request)
        task = await self._federation.poll(device, profile, request.p2p_peer_id, conditions)
        return pb.PollReply() if task is None else pb.PollReply(task=wire.work_to_pb(task.order))

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Context) -> pb.HeartbeatReply:
        device = await self._device(context)
        conditions = wire.conditions_of(request)
        round_open = self._federation.heartbeat(device, request.round_token, conditions)
        return pb.HeartbeatReply(round_open=round_open)

    async def FetchModel(self, request: pb.FetchModelRequest, context: Context) -> None:
        device = await self._device(context)
        idle_s = self._idle_s
        pieces = self._federation.fetch_model(device, request.sha256)
        async with contextlib.aclosing(pieces):
            async for piece in pieces:
                try:
                    # A reader that stops reading must not hold a download slot forever.
                    await asyncio.wait_for(context.write(wire.blob_to_wire(piece)), idle_s)
                except asyncio.TimeoutError:
                    raise Refusal(
                        grpc.StatusCode.DEADLINE_EXCEEDED, f"download stalled for {idle_s:.0f}s"
                    ) from None

    async def ReserveUpload(
        self, request: pb.ReserveUploadRequest, context: Context
    ) -> pb.ReserveUploadReply:
        device = await self._device(context)
        reservation = await self._federation.reserve_upload(
            device, wire.round_ref(request), request.payload_size
        )
        return pb.ReserveUploadReply(reservation=reservation.key, expires_in_s=reservation.ttl_s)

    async def SubmitUpdate(
        self, request_iterator: AsyncIterator[UpdatePart], context: Context
    ) -> pb.SubmitReply:
        device = await self._device(context)
        parts = aiter(request_iterator)
        try:
            first = await asyncio.wait_for(anext(parts, None), self._idle_s)
        except asyncio.TimeoutError:
            raise WireError("no update header arrived") from None
        if first is None or first.header is None:
            raise WireError("the first message of an update must be its header")
        header = wire.header_from_pb(first.header)
        await self._federation.submit_update(device, header, wire.update_payload(parts))
        return pb.SubmitReply(accepted=True, detail="aggregated")

    async def ReportAverage(
        self, request: pb.AverageReport, context: Context
    ) -> pb.AverageReportReply:
        device = await self._device(context)
        report = wire.report_from_pb(device.id, request)
        verdict = await self._federation.report_average(device, wire.round_ref(request), report)
        return pb.AverageReportReply(upload=verdict.upload, round_open=verdict.round_open)

    async def GiveUp(self, request: pb.GiveUpRequest, context: Context) -> pb.GiveUpReply:
        device = await self._device(context)
        self._federation.report_failure(device, wire.round_ref(request), request.reason)
        return pb.GiveUpReply()

    async def SecAgg(self, request: pb.SecAggRequest, context: Context) -> pb.SecAggReply:
        device = await self._device(context)
        body = await self._federation.secagg(
            device, wire.round_ref(request), request.stage, request.body
        )
        return pb.SecAggReply(body=body)

    async def Leave(self, request: pb.LeaveRequest, context: Context) -> pb.LeaveReply:
        device = await self._device(context)
        self._federation.leave(device, request.reason)
        return pb.LeaveReply()
