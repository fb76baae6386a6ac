"""Edge and mobile devices: what a device without torch or grpc needs to join a federation.

- ``lite``: the torch-free reference client (``flotilla-lite``), standard library and NumPy.

This package imports nothing itself, so each part loads only what it needs.
"""

__all__: list[str] = []
