"""The agent's requests over gRPC, the wire every server speaks today.

Everything gRPC the agent does lives here: the channel, the stubs, the two bulk calls
framed by hand (``flotilla.proto.bulk``, which spares model-sized copies), the one table
from status codes to errors, and the protobuf <-> ``flotilla.core`` conversions.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

import grpc

from flotilla.client.channel import RETRYABLE, credential_metadata, open_channel
from flotilla.client.transport import (
    AgentRequest,
    AverageReport,
    Buffer,
    DeviceCredential,
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
from flotilla.core.device import DeviceProfile
from flotilla.core.errors import (
    AuthError,
    FlotillaError,
    ForbiddenError,
    NotFoundError,
    StaleRoundError,
    Unreachable,
    UpdateRejected,
    WireError,
)
from flotilla.core.work import ReportVerdict, Reservation, RoundRef, UploadHeader, WorkOrder
from flotilla.proto import PROTOCOL_VERSION, bulk
from flotilla.proto import flotilla_pb2 as pb
from flotilla.proto import flotilla_pb2_grpc as pb_grpc
from flotilla.proto.bulk import BlobPiece
from flotilla.proto.conditions import conditions_to_pb

R = TypeVar("R")

#: What each status code the server answers with means to the agent.
_ERRORS: Mapping[grpc.StatusCode, type[FlotillaError]] = {
    grpc.StatusCode.UNAUTHENTICATED: AuthError,
    # A revoked device: final (an AuthError would have the agent enrol again).
    grpc.StatusCode.PERMISSION_DENIED: ForbiddenError,
    # After enrolment the server's only precondition is that the round is still this one.
    grpc.StatusCode.FAILED_PRECONDITION: StaleRoundError,
    # The server answers malformed (WireError) and unacceptable (UpdateRejected) requests
    # alike; to the device both mean that what it sent will not count.
    grpc.StatusCode.INVALID_ARGUMENT: UpdateRejected,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    **dict.fromkeys(RETRYABLE, Unreachable),
}
#: At enrolment the one precondition is the protocol version: a refusal, not a stale round.
_ENROL_ERRORS = {**_ERRORS, grpc.StatusCode.FAILED_PRECONDITION: FlotillaError}


def translate(
    exc: grpc.aio.AioRpcError, table: Mapping[grpc.StatusCode, type[FlotillaError]] = _ERRORS
) -> FlotillaError:
    """The error of ``flotilla.core.errors`` that a failed call means (by ``table``)."""
    code = exc.code()
    cls = table.get(code, FlotillaError)
    details = exc.details() or ""
    if cls is Unreachable or not details:
        return cls(f"{code.name}: {details}" if details else code.name)
    return cls(details)


@dataclass(frozen=True, slots=True)
class _Connection:
    channel: grpc.aio.Channel
    stub: pb_grpc.AgentStub
    fetch_model: grpc.aio.UnaryStreamMultiCallable[pb.FetchModelRequest, BlobPiece]
    submit_update: grpc.aio.StreamUnaryMultiCallable[bytes, pb.SubmitReply]

    @classmethod
    def open(
        cls, server: str, tls_ca: Path | None, tls_cert: Path | None, tls_key: Path | None
    ) -> _Connection:
        channel = open_channel(server, tls_ca, tls_cert, tls_key)
        return cls(
            channel,
            pb_grpc.AgentStub(channel),
            # The bulk calls, framed by hand (flotilla.proto.bulk) to spare model-sized copies.
            channel.unary_stream(
                "/flotilla.v1.Agent/FetchModel",
                request_serializer=pb.FetchModelRequest.SerializeToString,
                response_deserializer=bulk.read_blob_chunk,
            ),
            channel.stream_unary(
                "/flotilla.v1.Agent/SubmitUpdate",
                request_serializer=None,  # the messages are serialized already
                response_deserializer=pb.SubmitReply.FromString,
            ),
        )


class GrpcTransport:
    """The agent's transport to ``flotilla server``; the channel opens at the first send
    (inside the event loop that uses it) and again after :meth:`aclose`.

    ``server`` may name several servers of one deployment, ``HOST:PORT,HOST:PORT``: calls
    go to one at a time, and after a call finds it unreachable (down, or sending the
    device to another server of the deployment) the next call goes to the next one,
    round the list. With one address (a load balancer's) the next call after an
    ``UNAVAILABLE`` reconnects.
    """

    def __init__(
        self,
        server: str,
        tls_ca: Path | None = None,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
    ) -> None:
        """``tls_cert``/``tls_key``: the device's own certificate, for mutual TLS."""
        self.servers = tuple(s.strip() for s in server.split(",") if s.strip())
        if not self.servers:
            raise ValueError("no server address given")
        self._at = 0
        self._tls = (tls_ca, tls_cert, tls_key)
        self._conn: _Connection | None = None

    @property
    def server(self) -> str:
        """The server calls go to now."""
        return self.servers[self._at]

    async def send(self, request: Request[R]) -> R:
        known = closed_set(request)
        if self._conn is None:
            self._conn = _Connection.open(self.server, *self._tls)
        try:
            reply = await self._dispatch(self._conn, known)
        except grpc.aio.AioRpcError as exc:
            error = translate(exc, _ENROL_ERRORS if isinstance(known, Enrol) else _ERRORS)
            if type(error) is Unreachable and (
                len(self.servers) > 1 or exc.code() == grpc.StatusCode.UNAVAILABLE
            ):  # with one address, a load balancer's: reconnecting may reach another server
                await self._next_server()
            raise error from exc
        return cast(R, reply)

    async def _next_server(self) -> None:
        await self.aclose()
        self._at = (self._at + 1) % len(self.servers)

    async def aclose(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            await conn.channel.close(None)

    async def _dispatch(self, conn: _Connection, r: AgentRequest) -> object:
        stub = conn.stub
        match r:
            case Enrol():
                enrol = pb.EnrolRequest(
                    protocol_version=PROTOCOL_VERSION,
                    token=r.token,
                    profile=profile_to_pb(r.profile),
                    public_key=r.public_key,
                )
                got = await stub.Enrol(enrol, timeout=r.timeout_s)
                return DeviceCredential(got.device_id, got.credential)
            case SpeedTest():
                md = credential_metadata(r.credential)
                speed = await stub.SpeedTest(_speed_chunks(r), metadata=md, timeout=r.timeout_s)
                return int(speed.bytes)
            case Poll():
                poll = pb.PollRequest(p2p_peer_id=r.peer_id)
                if r.profile is not None:
                    poll.profile.CopyFrom(profile_to_pb(r.profile))
                if r.conditions is not None:
                    poll.conditions.CopyFrom(conditions_to_pb(r.conditions))
                md = credential_metadata(r.credential)
                reply = await stub.Poll(poll, metadata=md, timeout=r.timeout_s)
                return work_from_pb(reply.task) if reply.HasField("task") else None
            case Heartbeat():
                beat = pb.HeartbeatRequest(round_token=r.round_token)
                if r.conditions is not None:
                    beat.conditions.CopyFrom(conditions_to_pb(r.conditions))
                md = credential_metadata(r.credential)
                alive = await stub.Heartbeat(beat, metadata=md, timeout=r.timeout_s)
                return alive.round_open
            case FetchModel():
                fetch = pb.FetchModelRequest(job_id=r.job_id, sha256=r.sha256)
                md = credential_metadata(r.credential)
                return _blob_pieces(conn.fetch_model(fetch, metadata=md, timeout=r.timeout_s))
            case ReserveUpload():
                reserve = pb.ReserveUploadRequest(
                    job_id=r.ref.job_id,
                    round=r.ref.round,
                    round_token=r.ref.round_token,
                    payload_size=r.payload_size,
                )
                md = credential_metadata(r.credential)
                room = await stub.ReserveUpload(reserve, metadata=md, timeout=r.timeout_s)
                return Reservation(room.reservation, room.expires_in_s)
            case SubmitUpdate():
                md = credential_metadata(r.credential)
                done = await conn.submit_update(_update_frames(r), metadata=md, timeout=r.timeout_s)
                return Receipt(done.accepted, done.detail)
            case ReportAverage():
                md = credential_metadata(r.credential)
                report = report_to_pb(r.ref, r.report)
                verdict = await stub.ReportAverage(report, metadata=md, timeout=r.timeout_s)
                return ReportVerdict(verdict.upload, verdict.round_open)
            case GiveUp():
                ref = r.ref
                give_up = pb.GiveUpRequest(
                    job_id=ref.job_id, round=ref.round, round_token=ref.round_token, reason=r.reason
                )
                md = credential_metadata(r.credential)
                await stub.GiveUp(give_up, metadata=md, timeout=r.timeout_s)
                return None
            case SecAggMessage():
                ref = r.ref
                message = pb.SecAggRequest(
                    job_id=ref.job_id, round=ref.round, round_token=ref.round_token,
                    stage=r.stage, body=r.body,
                )  # fmt: skip
                md = credential_metadata(r.credential)
                reply = await stub.SecAgg(message, metadata=md, timeout=r.timeout_s)
                return bytes(reply.body)
            case Leave():
                leave = pb.LeaveRequest(reason=r.reason)
                md = credential_metadata(r.credential)
                await stub.Leave(leave, metadata=md, timeout=r.timeout_s)
                return None
        raise TypeError(f"{type(r).__name__} has no gRPC call")  # pragma: no cover


async def _speed_chunks(request: SpeedTest) -> AsyncIterator[pb.SpeedChunk]:
    async for data in request.chunks:
        yield pb.SpeedChunk(data=bytes(data))  # no copy for bytes


async def _update_frames(request: SubmitUpdate) -> AsyncIterator[bytes]:
    """``UpdateChunk`` messages, serialized straight from the payload (one copy each)."""
    yield bulk.update_header(header_to_pb(request.header))
    async for piece in request.chunks:
        yield bulk.update_data(piece)


async def _blob_pieces(
    call: grpc.aio.UnaryStreamCall[pb.FetchModelRequest, BlobPiece],
) -> AsyncIterator[Buffer]:
    """A download's payload in order, as views into the received messages."""
    position = 0
    try:
        async for piece in call:
            if piece.offset != position:
                raise WireError(f"chunk at offset {piece.offset}, expected {position}")
            position += len(piece.data)
            yield piece.data
    except grpc.aio.AioRpcError as exc:
        raise translate(exc) from exc
    finally:
        call.cancel()  # a reader that stopped early must not leave the stream open


# --- protobuf <-> flotilla.core --------------------------------------------------------------


def profile_to_pb(profile: DeviceProfile) -> pb.DeviceProfile:
    return pb.DeviceProfile(
        tasks=list(profile.tasks),
        gflops=profile.gflops,
        memory_bytes=profile.memory_bytes,
        upload_bytes_per_s=profile.upload_bytes_per_s,
        device_class=profile.device_class,
        samples=dict(profile.samples),
    )


def work_from_pb(msg: pb.TrainTask) -> WorkOrder:
    return WorkOrder(
        job_id=msg.job_id,
        round=msg.round,
        round_token=msg.round_token,
        task=msg.task,
        config_json=msg.config_json,
        model_sha256=msg.model_sha256,
        model_size=msg.model_size,
        deadline=msg.deadline_unix,
        seed=msg.seed,
        delta_base_sha256=msg.delta_base_sha256,
        delta_sha256=msg.delta_sha256,
        delta_size=msg.delta_size,
        uplink_codec=msg.uplink_codec,
    )


def header_to_pb(header: UploadHeader) -> pb.UpdateHeader:
    return pb.UpdateHeader(
        job_id=header.ref.job_id,
        round=header.ref.round,
        round_token=header.ref.round_token,
        num_samples=header.num_samples,
        metrics=dict(header.metrics),
        payload_size=header.payload_size,
        payload_sha256=header.payload_sha256,
        codec=header.codec,
        reservation=header.reservation,
        nonce=header.nonce,
        signature=header.signature,
    )


def report_to_pb(ref: RoundRef, report: AverageReport) -> pb.AverageReport:
    return pb.AverageReport(
        job_id=ref.job_id,
        round=ref.round,
        round_token=ref.round_token,
        model_sha256=report.model_sha256,
        group_id=report.group_id,
        contributors=[
            pb.Participation(device_id=c.device_id, num_samples=c.num_samples, metrics=c.metrics)
            for c in report.contributors
        ],
        allreduce_seconds=report.allreduce_s,
        reverted=report.reverted,
    )


__all__ = ["GrpcTransport", "header_to_pb", "profile_to_pb", "report_to_pb", "translate"]
