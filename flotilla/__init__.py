"""Flotilla: federated and volunteer collaborative training on one round engine.

Subpackages: ``core`` (shared types, wire format, errors), ``aggregation``, ``scheduling``,
``engine`` (the round engine), ``server``, ``client`` (the device agent), ``tasks``
(built-in tasks). See docs/architecture.md.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
