"""The gRPC edge of the federation server: it imports the core, the core never imports it.

- ``edge``: :class:`GrpcEdge`, the grpc.aio server both services run on.
- ``agent`` / ``operator``: the servicers, thin: protobuf in, one facade call, protobuf out.
- ``wire``: every protobuf <-> core conversion.
- ``status``: the one table from Flotilla's errors to status codes, applied around handlers.
- ``limits``: :class:`CallCap`, the interceptor capping calls in flight per peer address.
"""
