"""What stands in front of every HTTP route: bearer tokens, and the one table from
Flotilla's errors to HTTP statuses and stable error codes.

Every ``/api/`` route and ``/metrics`` need a token (read scope at least; writes the
operator's); the rest (health, the OpenAPI document, the page's static files) need none.
A token is read from the ``Authorization`` header only, never from the query string, and
the access log records method, path, status and time: nothing that can hold a token.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from flotilla.core.access import Scope
from flotilla.core.errors import (
    AuthError,
    ConflictError,
    FlotillaError,
    ForbiddenError,
    NotFoundError,
    SpecError,
    TaskLoadError,
    Unreachable,
    WireError,
)
from flotilla.dashboard import render

log = logging.getLogger(__name__)

#: Looked up along the error's MRO, so the most specific entry wins (a ForbiddenError is
#: an AuthError, but 403). The codes are part of the API: clients match on them.
ERRORS: Mapping[type[BaseException], tuple[int, str]] = {
    ForbiddenError: (403, "forbidden"),
    AuthError: (401, "unauthorized"),
    NotFoundError: (404, "not_found"),
    SpecError: (400, "invalid_spec"),
    TaskLoadError: (400, "invalid_spec"),
    WireError: (400, "bad_request"),
    ConflictError: (409, "conflict"),
    Unreachable: (503, "unavailable"),
    # A refused state change, an exhausted privacy budget, a peer that did not start.
    FlotillaError: (409, "conflict"),
}

#: aiohttp's own refusals (no such route, wrong method, body too large) by status.
HTTP_CODES: Mapping[int, str] = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    415: "bad_request",
    503: "unavailable",
}

MISSING_TOKEN = (
    "this route needs a token: send the header 'Authorization: Bearer TOKEN' with the "
    "operator token (STATE_DIR/operator.token) or a read token "
    "('flotilla server token create --read-only')"
)

#: Where the route table keeps the routes only an operator token may call.
WRITE_ROUTES: web.AppKey[set[web.AbstractRoute]] = web.AppKey("flotilla_write_routes")


class Authorizer(Protocol):
    """Decides what a bearer token may do."""

    async def scope(self, token: str | None) -> Scope:
        """The token's scope; raises ``AuthError`` for a missing or unknown token."""
        ...


class StaticTokens:
    """An :class:`Authorizer` over a few tokens held in memory (``flotilla dashboard DIR``
    mints one per start; tests). Only hashes are kept, compared in constant time."""

    def __init__(self, tokens: Mapping[str, Scope]) -> None:
        self._hashes = [(_digest(token), scope) for token, scope in tokens.items()]

    async def scope(self, token: str | None) -> Scope:
        if not token:
            raise AuthError(MISSING_TOKEN)
        digest = _digest(token)
        granted = None
        for stored, scope in self._hashes:  # every entry compared: no early exit to time
            if hmac.compare_digest(digest, stored):
                granted = scope
        if granted is None:
            raise AuthError("token refused: use the token the server printed or minted")
        return granted


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def bearer(request: web.BaseRequest) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header, if any."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def protected(path: str) -> bool:
    return path.startswith("/api/") or path == "/metrics"


def error_response(status: int, code: str, message: str) -> web.Response:
    headers = {"Cache-Control": "no-store"}
    if status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="flotilla"'
    return web.Response(
        status=status,
        body=render.dumps(render.error_json(code, message)),
        content_type="application/json",
        headers=headers,
    )


def status_of(exc: BaseException) -> tuple[int, str] | None:
    """The status and code for ``exc``; None for an error not raised on purpose (a bug)."""
    for cls in type(exc).__mro__:
        found = ERRORS.get(cls)
        if found is not None:
            return found
    return None


RouteHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def guard(authorizer: Authorizer) -> Any:
    """The middleware: checks the token where one is needed, then maps whatever the handler
    raised to a JSON error (an unexpected exception is logged and answered ``internal``)."""

    @web.middleware
    async def middleware(request: web.Request, handler: RouteHandler) -> web.StreamResponse:
        try:
            if protected(request.path):
                granted = await authorizer.scope(bearer(request))
                if request.match_info.route in request.app[WRITE_ROUTES] and not granted.allows(
                    Scope.OPERATOR
                ):
                    raise ForbiddenError(
                        "a read-only token cannot change anything: use the operator token"
                    )
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = HTTP_CODES.get(exc.status, "bad_request" if exc.status < 500 else "internal")
            return error_response(exc.status, code, _http_message(exc))
        except FlotillaError as exc:
            found = status_of(exc)
            assert found is not None  # FlotillaError itself is in the table
            return error_response(found[0], found[1], str(exc))

    return middleware


@web.middleware
async def internal_errors(request: web.Request, handler: RouteHandler) -> web.StreamResponse:
    """The outermost middleware: a bug answers 500 ``internal`` with JSON, not a traceback."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return error_response(
            500, "internal", "the server failed on this request; its log says why"
        )


def _http_message(exc: web.HTTPException) -> str:
    if exc.status == 404:
        return "no such route: see /openapi.json for the routes this server has"
    if exc.status == 405:
        return f"method not allowed here; allowed: {exc.headers.get('Allow', 'none')}"
    if exc.status == 413:
        return "the request body is too large"
    return exc.reason


class SafeAccessLogger(AbstractAccessLogger):
    """One line per request: client, method, path (never the query string), status and
    milliseconds; no header is ever logged, so no token is."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        self.logger.info(
            "%s %s %s %d %.1fms",
            request.remote,
            request.method,
            request.path,
            response.status,
            time * 1000,
        )
