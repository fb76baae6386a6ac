"""The transport-free server core: what the federation is, whichever edge it is reached by.

- ``gateway``: :class:`Gateway`, the real-device Backend the round engine dispatches to.
- ``store`` / ``schema``: persistence (SQLAlchemy 2, SQLite or PostgreSQL).
- ``auth`` / ``tokens``: secrets and credentials (hashes only are stored).
- ``budget``: :class:`ByteBudget`, the bound on update bytes held at once.

Nothing here imports an edge (``flotilla.server.grpc``), ``flotilla.proto`` or grpc.
"""
