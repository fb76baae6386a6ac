"""The read routes of ``/api/v1`` and the dashboard's static page, over any
:class:`~flotilla.dashboard.model.ReadModel`: a live federation (``flotilla server``, which
adds its write routes to the same app) or a simulation's output directory (``flotilla
dashboard DIR``). Shapes: ``docs/http-api.md``; JSON built in :mod:`.render` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from flotilla.core.errors import NotFoundError, WireError
from flotilla.dashboard import render
from flotilla.dashboard.cache import Responses, RoundFragments
from flotilla.dashboard.events import ChangeStream, StreamSettings, serve
from flotilla.dashboard.guard import (
    WRITE_ROUTES,
    Authorizer,
    RouteHandler,
    bearer,
    guard,
    internal_errors,
)
from flotilla.dashboard.history import DeviceCountHistory, count
from flotilla.dashboard.model import ReadModel

log = logging.getLogger(__name__)

#: The page and its scripts, shipped in the package.
STATIC_DIR = Path(__file__).resolve().parent / "static"
#: What ``/api/v1/whoami`` says it serves: the page hides write buttons for a simulation.
SOURCES = ("server", "simulation")


@dataclass(frozen=True, slots=True)
class ReadAppConfig:
    streams: StreamSettings = field(default_factory=StreamSettings)
    #: The device history's length and how often it samples without being told.
    history_capacity: int = 720
    history_every_s: float = 10.0
    #: Devices' last-seen times and volunteer runs' status change without an event: their
    #: answers are rebuilt when older than this.
    max_age_s: float = 1.0
    #: Request bodies above this are refused (413): a job spec is a few kilobytes.
    max_body_bytes: int = 1024 * 1024
    static_dir: Path = STATIC_DIR


class ReadState:
    """What the read routes share: the model, rendered answers, streams, device history."""

    def __init__(
        self, model: ReadModel, authorizer: Authorizer, source: str, config: ReadAppConfig
    ) -> None:
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
        self.model = model
        self.authorizer = authorizer
        self.source = source
        self.config = config
        self.responses = Responses()
        self.fragments = RoundFragments()
        self.history = DeviceCountHistory(config.history_capacity)
        self.streams: set[ChangeStream] = set()
        self._sample_now = asyncio.Event()

    async def watching(self, app: web.Application) -> AsyncIterator[None]:
        """While the app runs: drop cached answers as the model changes, sample devices."""
        tasks = [asyncio.ensure_future(self._watch()), asyncio.ensure_future(self._sample())]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def close_streams(self, app: web.Application) -> None:
        for stream in list(self.streams):
            stream.close()

    async def _watch(self) -> None:
        async for change in self.model.changes.changes():
            self.responses.changed(change)
            if change.kind == "devices":
                self._sample_now.set()

    async def _sample(self) -> None:
        """A sample now, then on each devices change and every ``history_every_s``, but at
        most one a second: a fleet joining is one sample a second, not a storm."""
        loop = asyncio.get_running_loop()
        while True:
            sampled_at = loop.time()
            try:
                devices = await self.model.fleet.devices()
                self.history.record(count(time.time(), devices))
            except Exception:
                log.exception("sampling device counts failed")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._sample_now.wait(), self.config.history_every_s)
            self._sample_now.clear()
            await asyncio.sleep(max(0.0, sampled_at + 1.0 - loop.time()))


STATE = web.AppKey("flotilla_read_state", ReadState)


def json_response(body: bytes, status: int = 200) -> web.Response:
    return web.Response(
        status=status,
        body=body,
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


def since_of(request: web.Request) -> int:
    """``?since=N``: only rounds after N (0, the default: every round)."""
    raw = request.query.get("since", "0")
    try:
        since = int(raw)
    except ValueError:
        raise WireError(f"since must be a round number (an integer >= 0), got {raw!r}") from None
    if since < 0:
        raise WireError(f"since must be >= 0, got {since}")
    return since


class ReadRoutes:
    """One handler per read route."""

    def __init__(self, state: ReadState) -> None:
        self._s = state

    async def whoami(self, request: web.Request) -> web.Response:
        scope = await self._s.authorizer.scope(bearer(request))
        return json_response(render.dumps({"scope": scope.value, "source": self._s.source}))

    async def jobs(self, request: web.Request) -> web.Response:
        async def build() -> bytes:
            jobs = await self._s.model.jobs.jobs()
            return render.dumps({"jobs": [render.job_json(j) for j in jobs]})

        return json_response(await self._s.responses.get(("jobs",), build))

    async def job(self, request: web.Request) -> web.Response:
        job_id = request.match_info["id"]

        async def build() -> bytes:
            for job in await self._s.model.jobs.jobs():
                if job.id == job_id:
                    return render.dumps(render.job_json(job))
            raise NotFoundError(f"no job {job_id!r}: GET /api/v1/jobs lists the jobs")

        return json_response(await self._s.responses.get(("job", job_id), build))

    async def rounds(self, request: web.Request) -> web.Response:
        job_id = request.match_info["id"]
        since = since_of(request)

        async def build() -> bytes:
            return await self._rounds_body(job_id, 0)

        if since > 0:
            return json_response(await self._rounds_body(job_id, since))
        return json_response(await self._s.responses.get(("rounds", job_id), build))

    async def _rounds_body(self, job_id: str, since: int) -> bytes:
        rounds = await self._s.model.jobs.rounds(job_id)
        fragments = self._s.fragments
        return render.join_array(
            "rounds", (fragments.render(job_id, r) for r in rounds if r.round > since)
        )

    async def devices(self, request: web.Request) -> web.Response:
        async def build() -> bytes:
            devices = await self._s.model.fleet.devices()
            return render.dumps({"devices": [render.device_json(d) for d in devices]})

        body = await self._s.responses.get(("devices",), build, self._s.config.max_age_s)
        return json_response(body)

    async def device_history(self, request: web.Request) -> web.Response:
        samples = [
            {"t": s.t, "idle": s.idle, "busy": s.busy, "offline": s.offline}
            for s in self._s.history.samples()
        ]
        return json_response(render.dumps({"samples": samples}))

    async def volunteer_runs(self, request: web.Request) -> web.Response:
        async def build() -> bytes:
            runs = await self._s.model.fleet.volunteer_runs()
            return render.dumps({"volunteer_runs": [render.volunteer_run_json(r) for r in runs]})

        body = await self._s.responses.get(("volunteers",), build, self._s.config.max_age_s)
        return json_response(body)

    async def events(self, request: web.Request) -> web.StreamResponse:
        s = self._s
        return await serve(request, s.model.changes, s.streams, s.config.streams)

    async def index(self, request: web.Request) -> web.StreamResponse:
        page = self._s.config.static_dir / "index.html"
        if not page.is_file():
            raise NotFoundError("this installation has no dashboard page (static/index.html)")
        return web.FileResponse(page, headers={"Cache-Control": "no-cache"})


def add_write_route(app: web.Application, method: str, path: str, handler: RouteHandler) -> None:
    """A route only the operator token may call (a read token gets 403)."""
    app[WRITE_ROUTES].add(app.router.add_route(method, path, handler))


def build_read_app(
    model: ReadModel,
    authorizer: Authorizer,
    source: str,
    config: ReadAppConfig | None = None,
) -> web.Application:
    """An aiohttp app with every read route, the page at ``/`` and its files at
    ``/static/``; add write routes with :func:`add_write_route` before it starts."""
    config = config or ReadAppConfig()
    app = web.Application(
        middlewares=[internal_errors, guard(authorizer)], client_max_size=config.max_body_bytes
    )
    app[WRITE_ROUTES] = set()
    state = app[STATE] = ReadState(model, authorizer, source, config)
    routes = ReadRoutes(state)
    get = app.router.add_get
    get("/api/v1/whoami", routes.whoami)
    get("/api/v1/jobs", routes.jobs)
    get("/api/v1/jobs/{id}", routes.job)
    get("/api/v1/jobs/{id}/rounds", routes.rounds)
    get("/api/v1/devices", routes.devices)
    get("/api/v1/devices/history", routes.device_history)
    get("/api/v1/volunteer-runs", routes.volunteer_runs)
    get("/api/v1/events", routes.events)
    get("/", routes.index)
    if config.static_dir.is_dir():
        app.router.add_static("/static/", config.static_dir, follow_symlinks=False)
    app.cleanup_ctx.append(state.watching)
    app.on_shutdown.append(state.close_streams)
    return app


__all__ = [
    "STATIC_DIR",
    "ReadAppConfig",
    "ReadState",
    "add_write_route",
    "build_read_app",
    "json_response",
]
