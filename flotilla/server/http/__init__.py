"""The HTTP edge: the JSON API under ``/api/v1``, the device protocol under
``/device/v1``, ``/metrics``, health, the OpenAPI document and the dashboard page,
beside the gRPC edge over the same federation. It imports the transport-free core and
:mod:`flotilla.dashboard`, never the gRPC edge or the proto.

- ``edge``: :class:`HttpEdge`, the aiohttp app and its runner, started by the server.
- ``feed``: :class:`LiveFeed`, the federation's events as the dashboard's changes.
- ``readmodel``: the dashboard's read model over a live federation.
- ``routes``: submit, cancel, export, ``/metrics``, ``/healthz``, ``/readyz``.
- ``device``: the device protocol under ``/device/v1/`` (a sub-app: enrol, long poll,
  heartbeat, ``Range`` model downloads, resumable uploads; docs/protocol.md), with
  ``device_wire`` (strict JSON bodies), ``device_errors`` (its error table),
  ``staging`` (partial uploads on disk) and ``byteranges`` (``Range``/``Content-Range``).
- ``connections``: :class:`ConnectionLimit`, the cap on open connections per address.
- ``openapi``: :func:`document`, the OpenAPI 3.1 description of every route; importing
  it loads neither aiohttp nor the database stack (the docs site renders it).

Exports load lazily, as ``flotilla.server``'s do.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "HttpEdge": "flotilla.server.http.edge",
    "HttpSettings": "flotilla.server.http.edge",
    "LiveFeed": "flotilla.server.http.feed",
    "document": "flotilla.server.http.openapi",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'flotilla.server.http' has no attribute {name!r}")
