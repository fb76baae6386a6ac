"""The device protocol's one table from Flotilla's errors to HTTP statuses and stable codes,
and the middleware that applies it (and stamps the protocol version on every answer).

Devices need finer codes than the operator API's table: a stale round is final (410), a
refused update is not malformed (422), and a retryable refusal says so (503). Codes are
part of the protocol (docs/protocol.md): clients match on them, never on messages.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from flotilla.core.errors import (
    AuthError,
    ConflictError,
    FlotillaError,
    ForbiddenError,
    IntegrityError,
    NotFoundError,
    RateLimited,
    SpecError,
    StaleRoundError,
    Unreachable,
    UpdateRejected,
    WireError,
)
from flotilla.dashboard import render
from flotilla.dashboard.guard import RouteHandler
from flotilla.server.http.device_wire import PROTOCOL, PROTOCOL_HEADER

log = logging.getLogger(__name__)

#: Looked up along the error's MRO, so the most specific entry wins.
DEVICE_ERRORS: Mapping[type[BaseException], tuple[int, str]] = {
    ForbiddenError: (403, "forbidden"),
    AuthError: (401, "unauthorized"),
    NotFoundError: (404, "not_found"),
    IntegrityError: (422, "integrity"),
    WireError: (400, "bad_request"),
    SpecError: (400, "bad_request"),
    StaleRoundError: (410, "stale_round"),
    UpdateRejected: (422, "update_rejected"),
    ConflictError: (409, "conflict"),
    RateLimited: (429, "rate_limited"),
    Unreachable: (503, "unavailable"),
    FlotillaError: (409, "conflict"),
}

#: aiohttp's own refusals, by status.
_HTTP_CODES = {405: "method_not_allowed", 413: "payload_too_large", 404: "not_found"}


class DeviceRefusal(Exception):
    """A refusal only this edge makes (a range past the end, a chunk too large, an upload
    finalized twice), with its status, code and any headers the status calls for."""

    def __init__(
        self, status: int, code: str, message: str, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.headers = dict(headers or {})


def device_status(exc: BaseException) -> tuple[int, str] | None:
    for cls in type(exc).__mro__:
        found = DEVICE_ERRORS.get(cls)
        if found is not None:
            return found
    return None


def respond(body: dict[str, Any], status: int = 200) -> web.Response:
    """A JSON answer carrying the protocol version."""
    return web.Response(
        status=status,
        body=render.dumps({"protocol": PROTOCOL, **body}),
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


def error_answer(
    status: int, code: str, message: str, headers: Mapping[str, str] | None = None
) -> web.Response:
    response = respond(render.error_json(code, message), status)
    response.headers.update(headers or {})
    if status == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="flotilla-device"'
    if status == 503:
        response.headers["Retry-After"] = "5"
    return response


@web.middleware
async def device_errors(request: web.Request, handler: RouteHandler) -> web.StreamResponse:
    """Every answer of the device app: the handler's, or its error as JSON."""
    try:
        response = await handler(request)
    except DeviceRefusal as exc:
        response = error_answer(exc.status, exc.code, str(exc), exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = _HTTP_CODES.get(exc.status, "bad_request" if exc.status < 500 else "internal")
        response = error_answer(exc.status, code, exc.reason)
    except RateLimited as exc:
        wait = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
        response = error_answer(429, "rate_limited", str(exc), wait)
    except FlotillaError as exc:
        status, code = device_status(exc) or (409, "conflict")
        response = error_answer(status, code, str(exc))
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        response = error_answer(500, "internal", "the server failed on this request")
    if not response.prepared:
        response.headers[PROTOCOL_HEADER] = str(PROTOCOL)
    return response
