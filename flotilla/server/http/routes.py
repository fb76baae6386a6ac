"""The routes only a live server has: submit and cancel jobs, export a model, revoke a
device, ``/metrics``,
health, readiness and the OpenAPI document. The read routes come from
:mod:`flotilla.dashboard.app`; both map errors through the same table."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from flotilla.core.errors import SpecError, Unreachable, WireError
from flotilla.core.jobfile import job_specs_from_text
from flotilla.core.spec import JobSpec
from flotilla.dashboard import render
from flotilla.dashboard.app import add_write_route, json_response
from flotilla.server.federation.facade import Federation
from flotilla.server.http.openapi import document
from flotilla.server.http.readmodel import job_view
from flotilla.server.metrics import PrometheusMetrics

SOURCE = "request body"


def spec_from_body(raw: bytes, job: str | None) -> JobSpec:
    """The one job a submit request's body (job file TOML) describes; ``job`` picks one of a
    ``[[jobs]]`` file. A function of the bytes alone, so the fuzz harness runs it as is."""
    if not raw.strip():
        raise SpecError(f"{SOURCE}: empty: send the job spec TOML as the body")
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise WireError("the body must be UTF-8 TOML text") from None
    specs = job_specs_from_text(text, SOURCE, job)
    if len(specs) > 1:
        names = ", ".join(s.job.name for s in specs)
        raise SpecError(f"{SOURCE}: it describes {len(specs)} jobs ({names}): pick one ?job=NAME")
    (spec,) = specs
    return spec


@dataclass(frozen=True, slots=True)
class ServerRoutes:
    federation: Federation
    metrics: PrometheusMetrics
    #: Whether the store is open and the jobs resumed (and the server not stopping).
    ready: Callable[[], bool]
    #: A write to an export's reader that takes longer than this ends the download (its
    #: download slot is shared with devices fetching models).
    write_timeout_s: float = 15.0

    async def submit(self, request: web.Request) -> web.Response:
        spec = spec_from_body(await request.read(), request.query.get("job"))
        job = await self.federation.submit_job(spec.to_json())
        return json_response(render.dumps(render.job_json(job_view(job, spec.job.task))), 201)

    async def cancel(self, request: web.Request) -> web.Response:
        job = await self.federation.cancel_job(request.match_info["id"])
        task = JobSpec.from_json(job.spec_json).job.task
        return json_response(render.dumps(render.job_json(job_view(job, task))))

    async def revoke(self, request: web.Request) -> web.Response:
        record = await self.federation.revoke_device(request.match_info["id"])
        body = {"device_id": record.id, "revoked_at": record.revoked_at}
        return json_response(render.dumps(body))

    async def export(self, request: web.Request) -> web.StreamResponse:
        job_id = request.match_info["id"]
        async with contextlib.aclosing(self.federation.export_model(job_id)) as pieces:
            first = await anext(pieces)  # an unknown job fails here, before any header
            response = web.StreamResponse(
                headers={
                    "Content-Type": "application/octet-stream",
                    "Content-Disposition": f'attachment; filename="{job_id}.safetensors"',
                    "X-Checkpoint-Sha256": first.sha256,
                    "Cache-Control": "no-store",
                }
            )
            response.content_length = first.total_size
            await response.prepare(request)
            await self._write(response, first.data)
            async for piece in pieces:
                await self._write(response, piece.data)
        await response.write_eof()
        return response

    async def _write(self, response: web.StreamResponse, data: bytes) -> None:
        await asyncio.wait_for(response.write(data), self.write_timeout_s)

    async def prometheus(self, request: web.Request) -> web.Response:
        body, content_type = self.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def healthz(self, request: web.Request) -> web.Response:
        return json_response(render.dumps({"status": "ok"}))

    async def readyz(self, request: web.Request) -> web.Response:
        if not self.ready():
            raise Unreachable("not ready: the server is starting or stopping; try again shortly")
        return json_response(render.dumps({"status": "ready"}))

    async def openapi(self, request: web.Request) -> web.Response:
        return json_response(render.dumps(document()))

    def add_to(self, app: web.Application) -> None:
        add_write_route(app, "POST", "/api/v1/jobs", self.submit)
        add_write_route(app, "POST", "/api/v1/jobs/{id}/cancel", self.cancel)
        add_write_route(app, "POST", "/api/v1/devices/{id}/revoke", self.revoke)
        app.router.add_get("/api/v1/jobs/{id}/model", self.export)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/openapi.json", self.openapi)
