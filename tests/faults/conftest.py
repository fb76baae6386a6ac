"""Fixtures of the fault suite: ``cluster``, a PostgreSQL cluster of the test's own."""

from tests.support.postgres import cluster

__all__ = ["cluster"]
