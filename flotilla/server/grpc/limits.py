"""A cap on the gRPC calls one peer address has in flight at once, as a server
interceptor: a flood from one address is refused (RESOURCE_EXHAUSTED) before it reaches a
handler, and every other address is served as before."""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from flotilla.server.federation.ratelimit import ConcurrencyCap

__all__ = ["CallCap", "peer_address"]


def peer_address(peer: str) -> str:
    """``ipv4:1.2.3.4:5678`` -> ``ipv4:1.2.3.4`` (``ipv6:[::1]:5678`` -> ``ipv6:[::1]``):
    one key per host, whatever port each connection came from."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return f"{kind}:{rest.rpartition(':')[0]}"
    return peer  # unix sockets and the like: one key each


class CallCap(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """At most ``limit`` calls in flight per peer address."""

    def __init__(self, limit: int) -> None:
        self.cap = ConcurrencyCap(limit)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._call(handler.unary_unary),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._call(handler.unary_stream),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                self._call(handler.stream_unary),
                handler.request_deserializer,
                handler.response_serializer,
            )
        assert handler.stream_stream is not None
        return grpc.stream_stream_rpc_method_handler(
            self._call(handler.stream_stream),
            handler.request_deserializer,
            handler.response_serializer,
        )

    async def _enter(self, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        key = peer_address(context.peer())
        if not self.cap.enter(key):
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"rate limited: more than {self.cap.limit} calls in flight from {key}",
            )
        return key

    def _call(self, behaviour: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behaviour):

            @functools.wraps(behaviour)
            async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
                key = await self._enter(context)
                try:
                    async for item in behaviour(request, context):
                        yield item
                finally:
                    self.cap.leave(key)

            return stream

        @functools.wraps(behaviour)
        async def call(request: Any, context: Any) -> Any:
            key = await self._enter(context)
            try:
                return await behaviour(request, context)
            finally:
                self.cap.leave(key)

        return call
