"""Edge and mobile devices: what light devices that speak the HTTP device protocol need.

- ``schema/v1/``: JSON Schemas of every message of the device protocol (docs/protocol.md).
- ``lite``: the torch-free reference client (``lite.http``: the protocol's Python side).

Import-free on purpose: each part is imported by its own path.
"""

__all__: list[str] = []
