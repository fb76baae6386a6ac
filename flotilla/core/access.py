"""What a caller of the operator APIs may do: the scope its token grants.

The server core decides a token's scope (``Federation.authenticate``); the HTTP edge and the
dashboard's routes only compare it, so neither needs to know how tokens are stored.
"""

from __future__ import annotations

from enum import Enum


class Scope(str, Enum):
    """``operator``: everything; ``read``: the read routes only (a read-only token)."""

    OPERATOR = "operator"
    READ = "read"

    def allows(self, needed: Scope) -> bool:
        """Whether a caller holding this scope may call a route that needs ``needed``."""
        return self is Scope.OPERATOR or needed is Scope.READ
