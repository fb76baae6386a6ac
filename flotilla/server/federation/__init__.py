"""The transport-free server core: what the federation is, whichever edge it is reached by.

- ``facade``: :class:`Federation`, one method per thing a device or operator does; edges
  call only this.
- ``views``: the frozen values it takes and returns (``DeviceInfo``, ``JobDetail``...).
- ``devices`` / ``jobs`` / ``uploads``: enrolment and sightings; one runner per job;
  uploads admitted by reservation, checked and delivered.
- ``ports``: the protocols the hosted hivemind peers are seen through (``Rendezvous``).
- ``gateway``: :class:`Gateway`, the real-device Backend the round engine dispatches to.
- ``store`` / ``schema``: persistence (SQLAlchemy 2, SQLite or PostgreSQL).
- ``auth`` / ``tokens``: secrets and credentials (hashes only are stored); enrolment
  tokens with a use count, an expiry and revocation.
- ``peercert``: :class:`PeerCertificate`, a device's verified client certificate, and the
  rule binding its name to the device id (mutual TLS).
- ``ratelimit``: :class:`RateLimits`, per-device token buckets (polls, uploads) and
  per-address ones (enrolments), and the per-address caps both edges apply.
- ``budget``: :class:`ByteBudget`, the bound on update bytes held at once.

Nothing here imports an edge (``flotilla.server.grpc``), the hosted peers
(``flotilla.server.hosting``), ``flotilla.proto`` or grpc; errors come only from
``flotilla.core.errors``.
"""
