"""Per-device rate limits (token buckets) and per-address concurrency caps, the same for
both edges: a device that floods is told to wait (:class:`RateLimited`, with how long),
and every other device's calls go on as before.

Buckets are kept per (kind, key): polls and uploads by device id, enrolments by the
caller's address (there is no device yet). Memory is bounded: at ``max_keys`` buckets the
full ones (callers that stopped calling) are dropped first, then the oldest."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from flotilla.core.errors import RateLimited

__all__ = ["ConcurrencyCap", "RateLimited", "RateLimiter", "RateLimits", "TokenBucket"]


@dataclass(frozen=True, slots=True)
class RateLimits:
    """Rates in calls per second, bursts in calls; generous for an honest agent, which
    long-polls (one poll per ``poll_hold_s`` while idle) and uploads once a round."""

    polls_per_s: float = 10.0
    poll_burst: int = 50
    #: Per client address: a whole lab of devices behind one NAT enrols at once.
    enrols_per_s: float = 20.0
    enrol_burst: int = 200
    #: As many as polls: an honest device uploads at most once per task a poll gave it,
    #: and on a fast network with a small model a round takes well under a second (a
    #: lower rate throttled honest agents serving many short jobs).
    uploads_per_s: float = 10.0
    upload_burst: int = 50
    #: Connections one address may hold open at once on the HTTP edge.
    http_connections_per_address: int = 256
    #: Calls one peer address may have in flight at once on the gRPC edge.
    grpc_calls_per_address: int = 256
    #: Buckets held at once, whatever the number of callers.
    max_keys: int = 100_000

    def __post_init__(self) -> None:
        rates = (self.polls_per_s, self.enrols_per_s, self.uploads_per_s)
        counts = (
            self.poll_burst,
            self.enrol_burst,
            self.upload_burst,
            self.http_connections_per_address,
            self.grpc_calls_per_address,
            self.max_keys,
        )
        if not all(r > 0 and math.isfinite(r) for r in rates) or min(counts) < 1:
            raise ValueError(f"rate limits must be positive: {self}")


@dataclass(slots=True)
class TokenBucket:
    """``burst`` calls at once, then ``rate`` per second."""

    rate: float
    burst: float
    tokens: float
    at: float

    def take(self, now: float) -> float:
        """Spend one call: 0.0 if allowed, else the seconds until one is."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate

    def full(self, now: float) -> bool:
        return self.tokens + (now - self.at) * self.rate >= self.burst


class RateLimiter:
    """Token buckets for ``poll``, ``enrol`` and ``upload`` calls, keyed by caller."""

    def __init__(
        self, limits: RateLimits | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits or RateLimits()
        self._clock = clock
        l = self.limits  # noqa: E741
        self._kinds = {
            "poll": (l.polls_per_s, l.poll_burst),
            "enrol": (l.enrols_per_s, l.enrol_burst),
            "upload": (l.uploads_per_s, l.upload_burst),
        }
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    def take(self, kind: str, key: str) -> None:
        """Spend one ``kind`` call of ``key``'s; RateLimited (with the wait) when none is left."""
        rate, burst = self._kinds[kind]
        now = self._clock()
        bucket = self._buckets.get((kind, key))
        if bucket is None:
            self._make_room(now)
            bucket = self._buckets[(kind, key)] = TokenBucket(rate, burst, burst, now)
        wait = bucket.take(now)
        if wait > 0:
            what = "enrolments from this address" if kind == "enrol" else f"{kind}s"
            raise RateLimited(
                f"rate limited: too many {what} (at most {rate:g}/s, bursts of {burst}); "
                f"retry in {wait:.1f}s",
                retry_after_s=wait,
            )

    def __len__(self) -> int:
        return len(self._buckets)

    def _make_room(self, now: float) -> None:
        if len(self._buckets) < self.limits.max_keys:
            return
        for key in [k for k, b in self._buckets.items() if b.full(now)]:
            del self._buckets[key]
        excess = len(self._buckets) - self.limits.max_keys // 2
        for key in list(self._buckets)[: max(0, excess)]:  # the oldest, by insertion
            del self._buckets[key]


class ConcurrencyCap:
    """At most ``limit`` things at once per key (connections, calls in flight)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, int] = {}

    def enter(self, key: str) -> bool:
        """Take a place for ``key``; False (nothing taken) when it holds ``limit`` already."""
        held = self._held.get(key, 0)
        if held >= self.limit:
            return False
        self._held[key] = held + 1
        return True

    def leave(self, key: str) -> None:
        held = self._held.get(key, 0) - 1
        if held > 0:
            self._held[key] = held
        else:
            self._held.pop(key, None)

    def held(self, key: str) -> int:
        return self._held.get(key, 0)
