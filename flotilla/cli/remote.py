"""The operator's handle on a running server, over gRPC (what ``flotilla job ...`` uses).

A failed call becomes a Flotilla error whose message says what to do next: which address
could not be reached and whether TLS was expected, or which token file was refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from flotilla.core.blobs import BlobAssembler
from flotilla.core.errors import AuthError, FlotillaError, NotFoundError, SpecError, Unreachable
from flotilla.core.spec import JobSpec
from flotilla.core.timeouts import Timeouts
from flotilla.proto import flotilla_pb2 as pb
from flotilla.proto import flotilla_pb2_grpc as pb_grpc
from flotilla.proto.channel import open_channel
from flotilla.proto.conditions import conditions_from_pb

_ERRORS: dict[grpc.StatusCode, type[FlotillaError]] = {
    grpc.StatusCode.UNAUTHENTICATED: AuthError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.INVALID_ARGUMENT: SpecError,
}
#: Codes that mean try again later: nothing listens there, TLS on one side only, no answer
#: in time, or the server's database or disk is out for now (its StorageUnavailable).
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def operator_token(state_dir: Path | None, token: str | None) -> str:
    if token:
        return token
    if state_dir is None:
        raise AuthError("give --token or --state-dir (which holds operator.token)")
    path = Path(state_dir) / "operator.token"
    try:
        return path.read_text().strip()
    except FileNotFoundError as exc:
        raise AuthError(f"no operator token at {path}; has the server started there?") from exc


def token_origin(state_dir: Path | None, token: str | None) -> str:
    """Where :func:`operator_token` took the token from, for an error message."""
    return (
        "given with --token" if token else f"read from {Path(state_dir or '.') / 'operator.token'}"
    )


def device_json(info: pb.DeviceInfo) -> dict[str, Any]:
    """The ``devices list --json`` shape of one device."""
    return {
        "id": info.id,
        "state": info.state,
        "job_id": info.job_id or None,
        "reason": info.reason or None,
        "tasks": list(info.tasks),
        "gflops": info.gflops,
        "upload_bytes_per_s": info.upload_bytes_per_s,
        "last_seen": info.last_seen or None,
        "selected": dict(info.selected),
        "device_class": info.device_class or None,
        # What it last reported (None: not seen since the server started).
        "conditions": (
            conditions_from_pb(info.conditions).to_dict() if info.HasField("conditions") else None
        ),
        # Running job -> why that job may not select it now.
        "ineligible": dict(info.ineligible),
        # Task -> training samples it holds, as it last reported.
        "samples": dict(info.samples),
    }


def job_json(info: pb.JobInfo, with_rounds: bool = False) -> dict[str, Any]:
    """The ``job status --json`` shape (``--rounds``: with every committed round)."""
    out: dict[str, Any] = {
        "id": info.id,
        "name": info.name,
        "state": info.state,
        "task": info.task,
        "rounds_committed": info.rounds_committed,
        "rounds_total": info.rounds_total,
        "metrics": dict(info.metrics),
        "created_at": info.created_at,
        "updated_at": info.updated_at,
    }
    if with_rounds:
        out["rounds"] = [round_json(r) for r in info.rounds]
    return out


def round_json(r: pb.RoundInfo) -> dict[str, Any]:
    """One round of ``job status --json --rounds``: who delivered, and the round's account."""
    return {
        "round": r.round,
        "metrics": dict(r.metrics),
        "participants": list(r.participants),
        "devices": [
            {"device_id": d.device_id, "num_samples": d.num_samples, "metrics": dict(d.metrics)}
            for d in r.devices
        ],
        "started_at": r.started_at,
        "committed_at": r.committed_at,
        "checkpoint_sha256": r.checkpoint_sha256,
        "selected": list(r.selected),
        "failures": [{"device_id": f.device_id, "reason": f.reason} for f in r.failures],
        "stale": list(r.stale),
        "bytes_up": r.bytes_up,
        "bytes_down": r.bytes_down,
        "decisions": list(r.decisions),
    }


@dataclass
class RemoteServer:
    """Async operator calls with deadlines (``timeouts.operator_s`` per call,
    ``timeouts.export_s`` for a model export); gRPC errors become Flotilla errors."""

    target: str
    token: str
    tls_ca: Path | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    #: The operator's client certificate and key, for a server with ``--tls-client-ca``.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: Where the token came from (:func:`token_origin`): named when the server refuses it.
    token_from: str = "given with --token"

    @classmethod
    def of(
        cls,
        target: str,
        state_dir: Path | None,
        token: str | None,
        tls_ca: Path | None,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
    ) -> RemoteServer:
        """The server at ``target`` with the operator token from ``--token`` or
        ``--state-dir`` (as every operator command takes them)."""
        origin = token_origin(state_dir, token)
        return cls(
            target,
            operator_token(state_dir, token),
            tls_ca,
            token_from=origin,
            tls_cert=tls_cert,
            tls_key=tls_key,
        )

    async def __aenter__(self) -> RemoteServer:
        self._channel = open_channel(self.target, self.tls_ca, self.tls_cert, self.tls_key)
        # The generated stub module is untyped; each call below states its reply type.
        self._stub = pb_grpc.OperatorStub(self._channel)  # type: ignore[no-untyped-call]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._channel.close(None)

    @property
    def _md(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    async def _call(self, method: Any, request: Any) -> Any:
        timeout = self.timeouts.operator_s
        try:
            return await method(request, metadata=self._md, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise self._translate(exc, timeout) from exc

    async def submit(self, spec: JobSpec) -> pb.JobInfo:
        info: pb.JobInfo = await self._call(
            self._stub.SubmitJob, pb.SubmitJobRequest(spec_json=spec.to_json())
        )
        return info

    async def jobs(self) -> list[pb.JobInfo]:
        reply = await self._call(self._stub.ListJobs, pb.ListJobsRequest())
        return list(reply.jobs)

    async def devices(self, task: str = "", job_id: str = "") -> list[pb.DeviceInfo]:
        request = pb.ListDevicesRequest(task=task, job_id=job_id)
        reply = await self._call(self._stub.ListDevices, request)
        return list(reply.devices)

    async def revoke(self, device_id: str) -> pb.RevokeDeviceReply:
        request = pb.RevokeDeviceRequest(device_id=device_id)
        reply: pb.RevokeDeviceReply = await self._call(self._stub.RevokeDevice, request)
        return reply

    async def refusals(
        self, device_id: str = "", job_id: str = "", limit: int = 0
    ) -> list[pb.RefusalInfo]:
        request = pb.ListRefusalsRequest(device_id=device_id, job_id=job_id, limit=limit)
        reply = await self._call(self._stub.ListRefusals, request)
        return list(reply.refusals)

    async def volunteer_runs(self) -> list[pb.VolunteerRunInfo]:
        reply = await self._call(self._stub.ListVolunteerRuns, pb.ListVolunteerRunsRequest())
        return list(reply.runs)

    async def job(self, job_id: str, with_rounds: bool = False) -> pb.JobInfo:
        request = pb.GetJobRequest(job_id=job_id, with_rounds=with_rounds)
        info: pb.JobInfo = await self._call(self._stub.GetJob, request)
        return info

    async def cancel(self, job_id: str) -> pb.JobInfo:
        info: pb.JobInfo = await self._call(self._stub.CancelJob, pb.GetJobRequest(job_id=job_id))
        return info

    async def export(self, job_id: str, max_bytes: int = 2**34) -> bytes:
        call = self._stub.ExportModel(
            pb.GetJobRequest(job_id=job_id), metadata=self._md, timeout=self.timeouts.export_s
        )
        assembler: BlobAssembler | None = None
        try:
            async for chunk in call:
                if assembler is None:
                    assembler = BlobAssembler(chunk.total_size, chunk.sha256, max_bytes)
                assembler.add(chunk.data, chunk.offset)
        except grpc.aio.AioRpcError as exc:
            raise self._translate(exc, self.timeouts.export_s) from exc
        if assembler is None:
            raise NotFoundError(f"job {job_id} has no model")
        return bytes(assembler.finish())

    def _translate(self, exc: grpc.aio.AioRpcError, timeout_s: float) -> FlotillaError:
        code = exc.code()
        details = exc.details() or code.name
        if code in _UNREACHABLE:
            return Unreachable(self._unreachable(code, details, timeout_s))
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return AuthError(
                f"the server at {self.target} refused the operator token {self.token_from} "
                f"({details}): use the operator.token in that server's --state-dir, or --token"
            )
        return _ERRORS.get(code, FlotillaError)(details)

    def _unreachable(self, code: grpc.StatusCode, details: str, timeout_s: float) -> str:
        if self.tls_ca is None:
            how = "over plaintext gRPC (no --tls-ca)"
            hint = "If it serves TLS (--tls-cert), give --tls-ca CA.pem"
        else:
            how = f"over TLS (--tls-ca {self.tls_ca})"
            hint = (
                "A plaintext server needs no --tls-ca, and the server's certificate must "
                "name the host in --server"
            )
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            what = f"no answer from {self.target} {how} within {timeout_s:g}s"
        else:
            what = f"cannot reach a flotilla server at {self.target} {how}"
        return f"{what}: {details}. Is `flotilla server` running there? {hint}."
