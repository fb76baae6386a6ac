"""The device protocol over HTTP (``/device/v1/``): light devices (phones, single-board
computers, the torch-free lite client) join with plain HTTP and JSON.

Each handler calls the same :class:`Federation` methods the gRPC agent edge calls, so an
HTTP device is scheduled, checked and counted exactly like a gRPC agent; what only HTTP
has is here: strict JSON bodies (:mod:`.device_wire`), ``Range`` downloads and resumable
uploads staged on disk (:mod:`.staging`). The protocol is written down in
``docs/protocol.md`` and ``flotilla/mobile/schema/v1/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from flotilla.core.errors import AuthError, IntegrityError, StaleRoundError, WireError
from flotilla.core.records import DeviceRecord
from flotilla.core.timeouts import Timeouts
from flotilla.engine.backend import TrainTask
from flotilla.server.federation.facade import Federation
from flotilla.server.federation.peercert import PeerCertificate
from flotilla.server.federation.uploads import update_limit
from flotilla.server.federation.views import BlobSlice
from flotilla.server.http import device_wire as wire
from flotilla.server.http.byteranges import inclusive, parse_content_range, parse_range
from flotilla.server.http.device_errors import DeviceRefusal, device_errors, respond
from flotilla.server.http.staging import StagedUpload, UploadStaging


@dataclass(frozen=True, slots=True)
class DeviceSettings:
    #: Where partial uploads are staged, one directory per server process:
    #: STATE_DIR/device-uploads.
    staging_dir: Path
    timeouts: Timeouts = field(default_factory=Timeouts)
    #: All staged partial uploads together; beyond it a new upload is told to retry (503).
    max_staged_bytes: int = 1024**3
    #: JSON request bodies above this are refused (413) before they are read.
    max_json_bytes: int = 64 * 1024
    #: The chunk size devices are told to use, and the largest chunk taken (413 above).
    chunk_bytes: int = 1024 * 1024
    max_chunk_bytes: int = 8 * 1024 * 1024
    #: The largest secure-round stage message taken (413 above), as gRPC's message limit.
    max_secagg_bytes: int = 8 * 1024 * 1024


class DeviceRoutes:
    """One handler per device endpoint, over one federation and one staging area."""

    def __init__(
        self, federation: Federation, settings: DeviceSettings, clock: Callable[[], float]
    ) -> None:
        self._federation = federation
        self._s = settings
        self._clock = clock
        self._staging = UploadStaging(settings.staging_dir, settings.max_staged_bytes, clock)
        #: The task each device was last handed here: its upload limit and deadline.
        self._offered: dict[str, TrainTask] = {}

    # --- plumbing ------------------------------------------------------------------------

    async def _device(self, request: web.Request) -> DeviceRecord:
        scheme, _, value = request.headers.get("Authorization", "").partition(" ")
        device_id, _, secret = value.strip().partition(":")
        if scheme.lower() != "bearer" or not device_id or not secret:
            raise AuthError(
                "send 'Authorization: Bearer DEVICE_ID:CREDENTIAL' with what enrolment returned"
            )
        return await self._federation.authenticate_device(
            device_id, secret, peer_certificate(request)
        )

    async def _json(self, request: web.Request, where: str) -> object:
        cap = self._s.max_json_bytes
        if request.content_length is not None and request.content_length > cap:
            raise DeviceRefusal(413, "payload_too_large", f"{where}: body over {cap} bytes")

        async def read() -> bytes:
            raw = bytearray()
            while block := await request.content.read(cap + 1 - len(raw)):
                raw += block
                if len(raw) > cap:
                    raise DeviceRefusal(413, "payload_too_large", f"{where}: body over {cap} bytes")
            return bytes(raw)

        try:
            raw = await asyncio.wait_for(read(), self._s.timeouts.upload_idle_s)
        except (asyncio.TimeoutError, ConnectionError):
            raise WireError(f"{where}: the body did not arrive whole, in time") from None
        return wire.loads(raw, where)

    # --- enrolment and work --------------------------------------------------------------

    async def enrol(self, request: web.Request) -> web.Response:
        token, profile, public_key = wire.enrol_request(await self._json(request, "enrol request"))
        credential = await self._federation.enrol(
            token,
            profile,
            public_key,
            cert=peer_certificate(request),
            address=request.remote or "",
        )
        body = {"device_id": credential.device_id, "credential": credential.secret}
        return respond(body, 201)

    async def poll(self, request: web.Request) -> web.Response:
        device = await self._device(request)
        profile, conditions = wire.poll_request(await self._json(request, "poll request"))
        task = await self._federation.poll(device, profile, conditions=conditions)
        if task is None:
            return respond({"task": None})
        self._offered[device.id] = task
        codec = task.order.uplink_codec or task.codec.name
        order = wire.task_json(task.order, codec, task.transport, update_limit(task))
        return respond({"task": order})

    async def heartbeat(self, request: web.Request) -> web.Response:
        device = await self._device(request)
        token, conditions = wire.heartbeat_request(await self._json(request, "heartbeat request"))
        return respond({"round_open": self._federation.heartbeat(device, token, conditions)})

    async def failure(self, request: web.Request) -> web.Response:
        device = await self._device(request)
        ref, reason = wire.failure_request(await self._json(request, "failure report"))
        self._federation.report_failure(device, ref, reason)
        self._offered.pop(device.id, None)
        return respond({"recorded": True})

    async def leave(self, request: web.Request) -> web.Response:
        device = await self._device(request)
        reason = wire.leave_request(await self._json(request, "leave request"))
        self._federation.leave(device, reason)
        self._offered.pop(device.id, None)
        return respond({"left": True})

    async def secagg(self, request: web.Request) -> web.Response:
        """One stage message of a secure round in (octet stream), the next one out, once
        the stage closes on the server."""
        device = await self._device(request)
        ref, stage = wire.secagg_path(request.match_info, request.headers)
        length = request.content_length
        if length is None:
            raise DeviceRefusal(411, "length_required", "send the message with a Content-Length")
        if length > self._s.max_secagg_bytes:
            raise DeviceRefusal(
                413,
                "payload_too_large",
                f"secure-round messages are at most {self._s.max_secagg_bytes} bytes",
            )
        try:
            body = await asyncio.wait_for(
                request.content.readexactly(length), self._s.timeouts.upload_idle_s
            )
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
            raise WireError(f"message truncated: fewer than its {length} bytes arrived") from None
        reply = await self._federation.secagg(device, ref, stage, body)
        return web.Response(body=reply, content_type="application/octet-stream")

    # --- model download ------------------------------------------------------------------

    async def model(self, request: web.Request) -> web.StreamResponse:
        device = await self._device(request)
        sha = request.match_info["sha256"]
        if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise WireError("the model's name is its SHA-256: 64 lowercase hex digits")
        etag = f'"{sha}"'
        pieces = self._federation.fetch_model(device, sha)
        async with contextlib.aclosing(pieces):
            first = await anext(pieces)  # not this device's model: refused here
            size = first.total_size
            headers = {
                "ETag": etag,
                "Accept-Ranges": "bytes",
                "Cache-Control": "private, no-transform",
                wire.PROTOCOL_HEADER: str(wire.PROTOCOL),
            }
            if _etag_matches(request.headers.get("If-None-Match", ""), etag):
                return web.Response(status=304, headers=headers)
            start, end, status = 0, size, 200
            asked = request.headers.get("Range")
            if asked is not None and request.headers.get("If-Range", etag) == etag:
                span = parse_range(asked, size)
                if span is None:
                    raise DeviceRefusal(
                        416,
                        "range_not_satisfiable",
                        f"the model has {size} bytes; ask for a range within 0-{size - 1}",
                        {"Content-Range": f"bytes */{size}"},
                    )
                (start, end), status = span, 206
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
            response = web.StreamResponse(status=status, headers=headers)
            response.content_type = "application/octet-stream"
            response.content_length = end - start
            await response.prepare(request)
            await self._send(request, response, _within(first, pieces, start, end))
        return response

    async def _send(
        self, request: web.Request, response: web.StreamResponse, data: AsyncIterator[bytes]
    ) -> None:
        """Write the body; a reader that stops reading loses its connection, not a slot."""
        try:
            async for block in data:
                await asyncio.wait_for(response.write(block), self._s.timeouts.upload_idle_s)
            await response.write_eof()
        except (asyncio.TimeoutError, ConnectionError):
            if request.transport is not None:
                request.transport.close()

    # --- uploads -------------------------------------------------------------------------

    async def create_upload(self, request: web.Request) -> web.Response:
        device = await self._device(request)
        header = wire.upload_request(await self._json(request, "upload request"))
        task = self._offered.get(device.id)
        if task is None or task.order.ref != header.ref:
            raise StaleRoundError(
                f"stale round: round {header.ref.round} of job {header.ref.job_id} is not "
                "open for this device"
            )
        limit = update_limit(task)
        if header.payload_size > limit:
            raise DeviceRefusal(
                413,
                "payload_too_large",
                f"update of {header.payload_size} bytes exceeds the limit of {limit}",
            )
        reservation = await self._federation.reserve_upload(device, header.ref, header.payload_size)
        expires = task.order.deadline + self._s.timeouts.upload_grace_s
        upload = self._staging.create(device.id, header, expires, reservation)
        return respond(self._upload_json(upload), 201)

    async def upload_status(self, request: web.Request) -> web.Response:
        device = await self._device(request)
        upload = self._staging.get(request.match_info["id"], device.id)
        return respond(self._upload_json(upload))

    async def put_chunk(self, request: web.Request) -> web.Response:
        device = await self._device(request)
        upload = self._staging.get(request.match_info["id"], device.id)
        _must_be_open(upload)
        start, end = parse_content_range(request.headers.get("Content-Range", ""), upload.size)
        length = request.content_length
        if length is None:
            raise DeviceRefusal(411, "length_required", "send the chunk with a Content-Length")
        if length > self._s.max_chunk_bytes:
            raise DeviceRefusal(
                413, "payload_too_large", f"chunks are at most {self._s.max_chunk_bytes} bytes"
            )
        if length != end - start:
            raise WireError(f"Content-Length {length} is not the {end - start} bytes of its range")
        try:
            data = await asyncio.wait_for(
                request.content.readexactly(length), self._s.timeouts.upload_idle_s
            )
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
            raise WireError(f"chunk truncated: fewer than its {length} bytes arrived") from None
        async with upload.lock:
            _must_be_open(upload)
            await self._staging.write(upload, start, data)
        return respond(self._upload_json(upload))

    async def finalize(self, request: web.Request) -> web.Response:
        device = await self._device(request)
        upload = self._staging.get(request.match_info["id"], device.id)
        _must_be_unsettled(upload)
        async with upload.lock:
            _must_be_unsettled(upload)
            missing = upload.received.missing(upload.size)
            if missing:
                raise DeviceRefusal(
                    409, "incomplete", f"bytes still missing: {inclusive(missing)[:8]}"
                )
            if await self._staging.sha256(upload) != upload.header.payload_sha256:
                self._staging.finish(upload, "refused", "sha256 mismatch")
                raise IntegrityError(
                    "the uploaded bytes do not match the declared sha256; start a new upload"
                )
            upload.state = "finalizing"
            await self._submit(device, upload)
        return respond({"accepted": True, "upload": self._upload_json(upload)})

    async def _submit(self, device: DeviceRecord, upload: StagedUpload) -> None:
        """The whole update to the core, once: it checks, decodes and delivers it."""
        try:
            held = upload.reservation
            fresh = held is not None and (
                self._clock() - upload.reserved_at < held.ttl_s - self._s.timeouts.heartbeat_s
            )
            if not fresh or held is None:
                held = await self._federation.reserve_upload(device, upload.header.ref, upload.size)
            upload.reservation = None
            header = dataclasses.replace(upload.header, reservation=held.key)
            await self._federation.submit_update(device, header, self._staging.chunks(upload))
        except BaseException as exc:
            self._staging.finish(upload, "refused", str(exc)[:256] or type(exc).__name__)
            raise
        self._staging.finish(upload, "accepted", "aggregated")
        self._offered.pop(device.id, None)

    def _upload_json(self, upload: StagedUpload) -> dict[str, Any]:
        return {
            "upload_id": upload.id,
            "size": upload.size,
            "sha256": upload.header.payload_sha256,
            "state": upload.state,
            "detail": upload.detail,
            "received": inclusive(upload.received.spans),
            "missing": inclusive(upload.received.missing(upload.size)),
            "chunk_bytes": self._s.chunk_bytes,
            "max_chunk_bytes": self._s.max_chunk_bytes,
            "expires_in_s": max(0.0, round(upload.expires_at - self._clock(), 3)),
        }

    # --- the app -------------------------------------------------------------------------

    async def _staged(self, app: web.Application) -> AsyncIterator[None]:
        """While the app runs: a clean staging area, swept as rounds end."""
        self._staging.open()

        async def sweep() -> None:
            while True:
                await asyncio.sleep(self._s.timeouts.heartbeat_every_s)
                self._staging.sweep()

        sweeper = asyncio.ensure_future(sweep())
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            self._staging.close()

    async def no_route(self, request: web.Request) -> web.Response:
        raise DeviceRefusal(
            404,
            "not_found",
            f"no device route {request.method} {request.path}: see docs/protocol.md",
        )

    def app(self) -> web.Application:
        """The sub-application to mount at ``/device/v1/``."""
        app = web.Application(middlewares=[device_errors])
        post = app.router.add_post
        post("/enrol", self.enrol)
        post("/poll", self.poll)
        post("/heartbeat", self.heartbeat)
        post("/failure", self.failure)
        post("/leave", self.leave)
        post("/secagg/{job_id}/{round}/{stage}", self.secagg)
        app.router.add_get("/models/{sha256}", self.model, allow_head=False)
        post("/uploads", self.create_upload)
        app.router.add_get("/uploads/{id}", self.upload_status, allow_head=False)
        app.router.add_put("/uploads/{id}", self.put_chunk)
        post("/uploads/{id}/finalize", self.finalize)
        app.router.add_route("*", "/{tail:.*}", self.no_route)
        app.cleanup_ctx.append(self._staged)
        return app


def build_device_app(federation: Federation, settings: DeviceSettings) -> web.Application:
    return DeviceRoutes(federation, settings, time.time).app()


def peer_certificate(request: web.Request) -> PeerCertificate | None:
    """The names of the client certificate TLS verified on this connection (the server's
    ``--tls-client-ca`` signed it); None without one."""
    transport = request.transport
    cert = transport.get_extra_info("peercert") if transport is not None else None
    if not cert:
        return None
    common = [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
    alt = [v for k, v in cert.get("subjectAltName", ()) if k in ("DNS", "URI")]
    return PeerCertificate(common[0] if common else "", tuple(alt))


def _etag_matches(header: str, etag: str) -> bool:
    tags = [t.strip().removeprefix("W/") for t in header.split(",")]
    return "*" in tags or etag in tags


def _must_be_open(upload: StagedUpload) -> None:
    if upload.state == "finalizing":
        raise DeviceRefusal(409, "finalizing", f"upload {upload.id} is being finalized")
    if upload.state != "open":
        raise DeviceRefusal(
            410,
            "gone",
            f"upload {upload.id} is {upload.state} ({upload.detail}); it takes no chunks",
        )


def _must_be_unsettled(upload: StagedUpload) -> None:
    if upload.state == "finalizing":
        raise DeviceRefusal(
            409, "finalizing", f"upload {upload.id} is being finalized: GET it for the verdict"
        )
    if upload.state != "open":
        raise DeviceRefusal(
            409,
            "already_finalized",
            f"upload {upload.id} was already {upload.state}: {upload.detail}",
        )


async def _within(
    first: BlobSlice, rest: AsyncIterator[BlobSlice], start: int, end: int
) -> AsyncIterator[bytes]:
    """The bytes ``[start, end)`` of a blob streamed as slices from offset 0."""
    offset = 0

    async def every() -> AsyncIterator[BlobSlice]:
        yield first
        async for piece in rest:
            yield piece

    async for piece in every():
        data = piece.data
        lo, hi = max(start - offset, 0), min(end - offset, len(data))
        if lo < hi:
            yield bytes(data[lo:hi])
        offset += len(data)
        if offset >= end:
            return
