"""The Operator service: submit, list, inspect, cancel and export jobs; list devices and runs;
revoke a device and read the refused updates."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from flotilla.proto import flotilla_pb2 as pb
from flotilla.server.federation.facade import Federation
from flotilla.server.grpc import wire
from flotilla.server.grpc.status import Context


class OperatorServicer:
    def __init__(self, federation: Federation) -> None:
        self._federation = federation

    async def _operator(self, context: Context) -> None:
        await self._federation.authenticate_operator(
            wire.bearer_token(context.invocation_metadata())
        )

    async def SubmitJob(self, request: pb.SubmitJobRequest, context: Context) -> pb.JobInfo:
        await self._operator(context)
        return wire.job_info(await self._federation.submit_job(request.spec_json))

    async def ListJobs(self, request: pb.ListJobsRequest, context: Context) -> pb.ListJobsReply:
        await self._operator(context)
        jobs = await self._federation.list_jobs()
        return pb.ListJobsReply(jobs=[wire.job_info(j) for j in jobs])

    async def GetJob(self, request: pb.GetJobRequest, context: Context) -> pb.JobInfo:
        await self._operator(context)
        detail = await self._federation.get_job(request.job_id, request.with_rounds)
        return wire.job_info(detail.job, detail.rounds)

    async def CancelJob(self, request: pb.GetJobRequest, context: Context) -> pb.JobInfo:
        await self._operator(context)
        return wire.job_info(await self._federation.cancel_job(request.job_id))

    async def ListDevices(
        self, request: pb.ListDevicesRequest, context: Context
    ) -> pb.ListDevicesReply:
        await self._operator(context)
        devices = await self._federation.list_devices(request.task, request.job_id)
        return pb.ListDevicesReply(devices=[wire.device_info_to_pb(d) for d in devices])

    async def RevokeDevice(
        self, request: pb.RevokeDeviceRequest, context: Context
    ) -> pb.RevokeDeviceReply:
        await self._operator(context)
        record = await self._federation.revoke_device(request.device_id)
        return pb.RevokeDeviceReply(device_id=record.id, revoked_at=record.revoked_at or 0.0)

    async def ListRefusals(
        self, request: pb.ListRefusalsRequest, context: Context
    ) -> pb.ListRefusalsReply:
        await self._operator(context)
        refusals = await self._federation.list_refusals(
            request.device_id or None, request.job_id or None, min(request.limit or 1000, 10_000)
        )
        return pb.ListRefusalsReply(refusals=[wire.refusal_to_pb(r) for r in refusals])

    async def ListVolunteerRuns(
        self, request: pb.ListVolunteerRunsRequest, context: Context
    ) -> pb.ListVolunteerRunsReply:
        await self._operator(context)
        runs = self._federation.volunteer_runs()
        return pb.ListVolunteerRunsReply(runs=[wire.volunteer_run_to_pb(r) for r in runs])

    async def ExportModel(
        self, request: pb.GetJobRequest, context: Context
    ) -> AsyncIterator[bytes]:
        await self._operator(context)
        # Closed even when the caller hangs up mid-stream, so its download slot is freed.
        async with contextlib.aclosing(self._federation.export_model(request.job_id)) as pieces:
            async for piece in pieces:
                yield wire.blob_to_wire(piece)
