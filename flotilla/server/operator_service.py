"""gRPC handlers for operators: submit, list, inspect, cancel and export jobs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from flotilla.core.errors import AuthError, FlotillaError, NotFoundError, SpecError
from flotilla.core.records import JobRecord, RoundRecord
from flotilla.proto import flotilla_pb2 as pb
from flotilla.proto import flotilla_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from flotilla.server.app import FederationServer


def job_info(job: JobRecord, rounds: list[RoundRecord] | None = None) -> pb.JobInfo:
    from flotilla.core.spec import JobSpec

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
    )
    for r in rounds or ():
        info.rounds.append(
            pb.RoundInfo(
                round=r.round,
                metrics=r.metrics,
                participants=[p.device_id for p in r.participants],
                started_at=r.started_at,
                committed_at=r.committed_at,
                checkpoint_sha256=r.checkpoint_sha256,
                devices=[
                    pb.Participation(
                        device_id=p.device_id, num_samples=p.num_samples, metrics=p.metrics
                    )
                    for p in r.participants
                ],
            )
        )
    return info


class OperatorService(pb_grpc.OperatorServicer):
    def __init__(self, server: FederationServer) -> None:
        self.server = server

    async def _operator(self, context: grpc.aio.ServicerContext) -> None:
        try:
            await self.server.authenticate_operator(context.invocation_metadata())
        except AuthError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))

    async def _job(self, job_id: str, context: grpc.aio.ServicerContext) -> JobRecord:
        job = await self.server.store.get_job(job_id)
        if job is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown job {job_id!r}")
        assert job is not None
        return job

    async def SubmitJob(
        self, request: pb.SubmitJobRequest, context: grpc.aio.ServicerContext
    ) -> pb.JobInfo:
        await self._operator(context)
        try:
            job = await self.server.submit_job(request.spec_json)
        except SpecError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except FlotillaError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return job_info(job)

    async def ListJobs(
        self, request: pb.ListJobsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListJobsReply:
        await self._operator(context)
        jobs = await self.server.store.list_jobs()
        return pb.ListJobsReply(jobs=[job_info(j) for j in jobs])

    async def GetJob(
        self, request: pb.GetJobRequest, context: grpc.aio.ServicerContext
    ) -> pb.JobInfo:
        await self._operator(context)
        job = await self._job(request.job_id, context)
        rounds = await self.server.store.list_rounds(job.id) if request.with_rounds else None
        return job_info(job, rounds)

    async def CancelJob(
        self, request: pb.GetJobRequest, context: grpc.aio.ServicerContext
    ) -> pb.JobInfo:
        await self._operator(context)
        await self._job(request.job_id, context)
        try:
            job = await self.server.cancel_job(request.job_id)
        except FlotillaError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return job_info(job)

    async def ListDevices(
        self, request: pb.ListDevicesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListDevicesReply:
        await self._operator(context)
        return pb.ListDevicesReply(devices=await self.server.device_infos(request.task))

    async def ListVolunteerRuns(
        self, request: pb.ListVolunteerRunsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListVolunteerRunsReply:
        await self._operator(context)
        runs = [pb.VolunteerRunInfo(**info) for info in self.server.volunteers.infos()]
        return pb.ListVolunteerRunsReply(runs=runs)

    async def ExportModel(
        self, request: pb.GetJobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        await self._operator(context)
        job = await self._job(request.job_id, context)
        try:
            async for message, _ in self.server.stream_blob(job.checkpoint_sha256):
                yield message
        except NotFoundError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
