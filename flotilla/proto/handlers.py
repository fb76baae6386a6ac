"""Registering a servicer with some methods' (de)serializers swapped for the bulk framing.

The generated ``add_*Servicer_to_server`` fixes protobuf's own serializers for every
method; the bulk paths need :mod:`flotilla.proto.bulk` instead. The handlers are built from
the service descriptor, so a method added to the ``.proto`` is registered here too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from flotilla.proto import flotilla_pb2 as pb

_PACKAGE = pb.DESCRIPTOR.package


def _pass_bytes(message: bytes) -> bytes:
    """A response already serialized (by :mod:`flotilla.proto.bulk`)."""
    return message


@dataclass(frozen=True, slots=True)
class Codecs:
    """Per-method replacements; ``None`` keeps protobuf's own."""

    request_deserializer: Callable[[bytes], Any] | None = None
    response_serializer: Callable[[Any], bytes] | None = None


#: A streamed response whose items are bytes from :mod:`flotilla.proto.bulk`.
PRESERIALIZED = Codecs(response_serializer=_pass_bytes)


def register(
    server: grpc.aio.Server,
    service: str,
    servicer: object,
    overrides: Mapping[str, Codecs] | None = None,
) -> None:
    """Add ``servicer``'s methods for ``service`` (e.g. ``"Agent"``) to ``server``."""
    overrides = overrides or {}
    descriptor = pb.DESCRIPTOR.services_by_name[service]
    unknown = set(overrides) - {m.name for m in descriptor.methods}
    if unknown:
        raise ValueError(f"{service} has no method(s) {sorted(unknown)}")
    handlers = {}
    for method in descriptor.methods:
        codecs = overrides.get(method.name, Codecs())
        request = getattr(pb, method.input_type.name)
        response = getattr(pb, method.output_type.name)
        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=codecs.request_deserializer or request.FromString,
            response_serializer=codecs.response_serializer or response.SerializeToString,
        )
    server.add_registered_method_handlers(f"{_PACKAGE}.{service}", handlers)
