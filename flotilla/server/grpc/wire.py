"""Every conversion between the protobuf messages and the core's values, in one place."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import cast

from flotilla.core.allreduce import Contribution
from flotilla.core.conditions import DeviceConditions
from flotilla.core.device import DeviceProfile
from flotilla.core.errors import WireError
from flotilla.core.records import JobRecord, RefusalRecord, RoundRecord
from flotilla.core.spec import JobSpec
from flotilla.core.work import RoundRef, UploadHeader, WorkOrder
from flotilla.engine.backend import Reported
from flotilla.proto import flotilla_pb2 as pb
from flotilla.proto.bulk import UpdatePart, blob_chunk
from flotilla.proto.conditions import conditions_from_pb, conditions_to_pb
from flotilla.server.federation import auth
from flotilla.server.federation.peercert import PeerCertificate
from flotilla.server.federation.views import BlobSlice, DeviceInfo, VolunteerRunInfo

DEVICE_HEADER = "x-flotilla-device"


# --- who is calling --------------------------------------------------------------------


def _pairs(metadata: object) -> tuple[tuple[str, str | bytes], ...]:
    """Call metadata as (key, value) pairs, which is how grpc.aio hands it to handlers."""
    return tuple(cast(Iterable[tuple[str, str | bytes]], metadata or ()))


def device_credentials(metadata: object) -> tuple[str | None, str | None]:
    """(device id, secret) from a device's call metadata; None where missing."""
    md = _pairs(metadata)
    return auth.header(md, DEVICE_HEADER), auth.bearer(md)


def peer_certificate(auth_context: Mapping[str, Iterable[bytes]]) -> PeerCertificate | None:
    """The names of the caller's verified client certificate (gRPC's auth context after a
    mutual TLS handshake); None without one."""
    common = [v.decode(errors="replace") for v in auth_context.get("x509_common_name", ())]
    alt = [
        v.decode(errors="replace") for v in auth_context.get("x509_subject_alternative_name", ())
    ]
    if not common and not alt:
        return None
    return PeerCertificate(common[0] if common else "", tuple(alt))


def bearer_token(metadata: object) -> str | None:
    return auth.bearer(_pairs(metadata))


# --- agent messages --------------------------------------------------------------------


def profile_from_pb(msg: pb.DeviceProfile, device_id: str = "") -> DeviceProfile:
    return DeviceProfile(
        device_id=device_id,
        tasks=tuple(msg.tasks),
        gflops=msg.gflops,
        memory_bytes=msg.memory_bytes,
        upload_bytes_per_s=msg.upload_bytes_per_s,
        device_class=msg.device_class,
        samples=dict(msg.samples),  # checked by the core (core.device.sample_counts)
    )


def conditions_of(msg: pb.PollRequest | pb.HeartbeatRequest) -> DeviceConditions | None:
    """The conditions a poll or heartbeat carries; None from an agent that sends none."""
    return conditions_from_pb(msg.conditions) if msg.HasField("conditions") else None


def work_to_pb(order: WorkOrder) -> pb.TrainTask:
    return pb.TrainTask(
        job_id=order.job_id,
        round=order.round,
        round_token=order.round_token,
        task=order.task,
        config_json=order.config_json,
        model_sha256=order.model_sha256,
        model_size=order.model_size,
        deadline_unix=order.deadline,
        seed=order.seed,
        delta_base_sha256=order.delta_base_sha256,
        delta_sha256=order.delta_sha256,
        delta_size=order.delta_size,
        uplink_codec=order.uplink_codec,
    )


def blob_to_wire(piece: BlobSlice) -> bytes:
    """A serialized ``BlobChunk`` (framed by hand: one copy of the data, see proto.bulk)."""
    return blob_chunk(piece.data, piece.offset, piece.total_size, piece.sha256)


def round_ref(
    msg: pb.ReserveUploadRequest
    | pb.AverageReport
    | pb.UpdateHeader
    | pb.GiveUpRequest
    | pb.SecAggRequest,
) -> RoundRef:
    return RoundRef(msg.job_id, msg.round, msg.round_token)


def header_from_pb(msg: pb.UpdateHeader) -> UploadHeader:
    return UploadHeader(
        ref=round_ref(msg),
        num_samples=msg.num_samples,
        payload_size=msg.payload_size,
        payload_sha256=msg.payload_sha256,
        codec=msg.codec,
        metrics=dict(msg.metrics),
        reservation=msg.reservation,
        nonce=msg.nonce,
        signature=msg.signature,
    )


async def update_payload(parts: AsyncIterator[UpdatePart]) -> AsyncIterator[memoryview]:
    """The payload chunks that follow an update's header; WireError at a second header."""
    async for part in parts:
        if part.data is None:
            raise WireError("an update carries exactly one header")
        yield part.data


def report_from_pb(device_id: str, msg: pb.AverageReport) -> Reported:
    """The report as sent; the core checks its shape once it knows the round is open."""
    return Reported(
        device_id=device_id,
        elapsed_s=0.0,
        model_sha256=msg.model_sha256,
        group_id=msg.group_id,
        contributors=tuple(
            Contribution.from_dict(
                {"device_id": c.device_id, "num_samples": c.num_samples, "metrics": dict(c.metrics)}
            )
            for c in msg.contributors
        ),
        allreduce_s=msg.allreduce_seconds,
        reverted=int(msg.reverted),
    )


# --- operator messages -----------------------------------------------------------------


def job_info(job: JobRecord, rounds: Sequence[RoundRecord] | None = None) -> pb.JobInfo:
    spec = JobSpec.from_json(job.spec_json)
    info = pb.JobInfo(
        id=job.id,
        name=job.name,
        state=job.state,
        rounds_committed=job.rounds_committed,
        rounds_total=job.rounds_total,
        metrics=job.metrics,
        task=spec.job.task,
        created_at=job.created_at,
        spec_json=job.spec_json,
        updated_at=job.updated_at,
    )
    info.rounds.extend(round_info(r) for r in rounds or ())
    return info


def round_info(r: RoundRecord) -> pb.RoundInfo:
    account = r.account
    return pb.RoundInfo(
        round=r.round,
        metrics=r.metrics,
        participants=[p.device_id for p in r.participants],
        started_at=r.started_at,
        committed_at=r.committed_at,
        checkpoint_sha256=r.checkpoint_sha256,
        devices=[
            pb.Participation(device_id=p.device_id, num_samples=p.num_samples, metrics=p.metrics)
            for p in r.participants
        ],
        selected=list(account.selected),
        failures=[
            pb.RoundFailure(device_id=f.device_id, reason=f.reason) for f in account.failures
        ],
        stale=list(account.stale),
        bytes_up=account.bytes_up,
        bytes_down=account.bytes_down,
        decisions=list(account.decisions),
    )


def refusal_to_pb(r: RefusalRecord) -> pb.RefusalInfo:
    return pb.RefusalInfo(
        at=r.at, device_id=r.device_id, job_id=r.job_id, round=r.round, reason=r.reason,
        detail=r.detail,
    )  # fmt: skip


def device_info_to_pb(info: DeviceInfo) -> pb.DeviceInfo:
    return pb.DeviceInfo(
        id=info.id,
        state=info.state,
        job_id=info.job_id,
        reason=info.reason,
        tasks=list(info.tasks),
        gflops=info.gflops,
        upload_bytes_per_s=info.upload_bytes_per_s,
        last_seen=info.last_seen,
        selected=dict(info.selected),
        device_class=info.device_class,
        conditions=None if info.conditions is None else conditions_to_pb(info.conditions),
        ineligible=dict(info.ineligible),
        samples=dict(info.samples),
    )


def volunteer_run_to_pb(info: VolunteerRunInfo) -> pb.VolunteerRunInfo:
    return pb.VolunteerRunInfo(
        run=info.run,
        task=info.task,
        maddrs=list(info.maddrs),
        coordinator_key=info.coordinator_key,
        status_json=info.status_json,
    )


__all__ = [
    "DEVICE_HEADER",
    "bearer_token",
    "blob_to_wire",
    "device_credentials",
    "device_info_to_pb",
    "header_from_pb",
    "job_info",
    "profile_from_pb",
    "refusal_to_pb",
    "report_from_pb",
    "round_info",
    "round_ref",
    "update_payload",
    "volunteer_run_to_pb",
    "work_to_pb",
]
