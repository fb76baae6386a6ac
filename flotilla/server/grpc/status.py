"""The one table from Flotilla's errors to gRPC status codes, applied around every handler.

A handler raises what the core raised (or :class:`Refusal` for the few limits only this
edge has); :func:`guarded` turns it into the caller's status with the error's message,
so codes and messages stay what clients match on (``flotilla.cli.remote`` reads them back).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, NoReturn

import grpc

from flotilla.core.errors import (
    AuthError,
    FlotillaError,
    ForbiddenError,
    NotFoundError,
    RateLimited,
    SpecError,
    StaleRoundError,
    Unreachable,
    UpdateRejected,
    WireError,
)

#: What every handler of both servicers is given besides its request.
Context = grpc.aio.ServicerContext[Any, Any]

#: Looked up along the error's MRO, so the most specific entry wins (a StaleRoundError
#: is FAILED_PRECONDITION although it is an UpdateRejected).
STATUS: Mapping[type[BaseException], grpc.StatusCode] = {
    AuthError: grpc.StatusCode.UNAUTHENTICATED,
    RateLimited: grpc.StatusCode.RESOURCE_EXHAUSTED,
    # The database or disk is out for now (StorageUnavailable): the caller backs off.
    Unreachable: grpc.StatusCode.UNAVAILABLE,
    # A revoked device: final, unlike a refused credential (which re-enrolment mends).
    ForbiddenError: grpc.StatusCode.PERMISSION_DENIED,
    NotFoundError: grpc.StatusCode.NOT_FOUND,
    SpecError: grpc.StatusCode.INVALID_ARGUMENT,
    WireError: grpc.StatusCode.INVALID_ARGUMENT,
    StaleRoundError: grpc.StatusCode.FAILED_PRECONDITION,
    UpdateRejected: grpc.StatusCode.INVALID_ARGUMENT,
    # A refused state change, an exhausted privacy budget, a hosted peer that did not start.
    FlotillaError: grpc.StatusCode.FAILED_PRECONDITION,
}


class Refusal(Exception):
    """A refusal of the gRPC edge itself, not the core's: a protocol version it does not
    speak, a stalled download, an overlong speed test."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


def status_of(exc: BaseException) -> grpc.StatusCode | None:
    """The status code for ``exc``; None for errors not raised on purpose (a bug)."""
    if isinstance(exc, Refusal):
        return exc.code
    for cls in type(exc).__mro__:
        code = STATUS.get(cls)
        if code is not None:
            return code
    return None


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: Exception) -> NoReturn:
    code = status_of(exc)
    if code is None:
        raise exc
    retry = getattr(exc, "retry_after_s", None)
    if retry is None:
        await context.abort(code, str(exc))
    else:  # a rate limit says how long to wait, as HTTP's Retry-After
        await context.abort(code, str(exc), (("retry-after", str(math.ceil(retry))),))
    raise AssertionError("unreachable: abort raises")


def _guard(handler: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            try:
                async for item in handler(request, context):
                    yield item
            except (FlotillaError, Refusal) as exc:
                await _abort(context, exc)

        return stream

    @functools.wraps(handler)
    async def unary(request: Any, context: Any) -> Any:
        try:
            return await handler(request, context)
        except (FlotillaError, Refusal) as exc:
            await _abort(context, exc)

    return unary


def guarded(servicer: object) -> object:
    """``servicer`` with every handler mapping Flotilla errors to status codes."""
    return _Guarded(servicer)


class _Guarded:
    def __init__(self, servicer: object) -> None:
        self._servicer = servicer

    def __getattr__(self, name: str) -> Callable[..., Any]:
        handler = getattr(self._servicer, name)
        if name.startswith("_") or not callable(handler):
            raise AttributeError(name)
        return _guard(handler)
