"""The federation server.

- ``app``: :class:`FederationServer` and :class:`ServerConfig`: wires everything, resumes jobs.
- ``agent_service`` / ``operator_service``: the gRPC handlers for agents and operators.
- ``gateway``: :class:`Gateway`, the real-device Backend the round engine dispatches to.
- ``store`` / ``schema`` / ``records``: persistence (SQLAlchemy 2, SQLite or PostgreSQL).
- ``auth``: tokens and credentials (hashes only are stored).
- ``remote``: :class:`RemoteServer`, the operator's gRPC client used by the CLI.

Exports load lazily so ``import flotilla.server.remote`` stays free of the database stack.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FederationServer": "flotilla.server.app",
    "ServerConfig": "flotilla.server.app",
    "Gateway": "flotilla.server.federation.gateway",
    "Store": "flotilla.server.federation.store",
    "RemoteServer": "flotilla.server.remote",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'flotilla.server' has no attribute {name!r}")
