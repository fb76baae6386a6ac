"""The federation server.

- ``app``: :class:`ServerConfig` and :class:`FederationServer`, the composition root:
  store, core, gRPC edge, reaper and hosted peers, started and stopped together.
- ``federation``: the transport-free core: the :class:`Federation` facade over devices,
  jobs, uploads and blobs; :class:`Gateway`, :class:`Store`, auth, the upload budget.
- ``grpc``: the gRPC edge: servicers, protobuf <-> core conversion, the error -> status table.
- ``hosting``: the hivemind peers the server runs as child processes (volunteer-run
  coordinators, the rendezvous of server-less rounds).
- ``process`` / ``memory``: settings of the server's whole process (BLAS threads, heap trim).

The operator's client (``RemoteServer``) lives with the CLI, in ``flotilla.cli.remote``.
Exports load lazily, so importing one submodule does not load the database stack.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FederationServer": "flotilla.server.app",
    "ServerConfig": "flotilla.server.app",
    "Federation": "flotilla.server.federation.facade",
    "Gateway": "flotilla.server.federation.gateway",
    "Store": "flotilla.server.federation.store",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'flotilla.server' has no attribute {name!r}")
