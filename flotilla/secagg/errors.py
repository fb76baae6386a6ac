"""SecAgg+ errors, each with a ``reason`` from a small fixed set (safe to log and record).

::

    FlotillaError
    └── SecAggError
        ├── SecAggMessageError  a message the server or a device will not take
        ├── SecAggAborted       the server cannot complete the round (the job retries it)
        └── SecAggRefused       a device stops: what the server asked is unsafe or inconsistent
"""

from __future__ import annotations

from typing import ClassVar

from flotilla.core.errors import FlotillaError


class SecAggError(FlotillaError):
    """Root of the SecAgg+ errors: ``reason`` is one of the class's ``REASONS``; ``detail``
    says more (bounded, no secrets)."""

    REASONS: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, reason: str, detail: str = "") -> None:
        if reason not in self.REASONS:
            raise ValueError(f"{type(self).__name__}: unknown reason {reason!r}")
        self.reason = reason
        self.detail = detail[:300]
        super().__init__(f"{reason}: {self.detail}" if self.detail else reason)


class SecAggMessageError(SecAggError):
    """Malformed, oversized, out-of-stage, duplicate or badly signed message: refused, and
    nothing the receiver kept changes."""

    REASONS = frozenset(
        {
            "malformed",
            "oversized",
            "wrong version",
            "out of stage",
            "duplicate",
            "unknown device",
            "bad signature",
        }
    )


class SecAggAborted(SecAggError):
    """The round cannot complete (too few devices left somewhere); nothing is unmasked."""

    REASONS = frozenset({"too few survivors", "reconstruction failed", "out of stage"})


class SecAggRefused(SecAggError):
    """A device stops answering, and says why; an honest device refuses rather than reveal
    what could unmask one neighbour's input."""

    REASONS = frozenset(
        {
            "malformed",
            "out of stage",
            "bad signature",
            "decryption failed",
            "too few neighbours",
            "too few signatures",
            "listed as dropped",
            "inconsistent survivors",
            "double reveal",
        }
    )
