"""The torch-free reference client: standard library plus NumPy, HTTP only.

- ``http``: :class:`~flotilla.mobile.lite.http.HttpDevice`, the device side of the HTTP
  device protocol (docs/protocol.md), standard library only.

Import-free on purpose: each part is imported by its own path.
"""

__all__: list[str] = []
