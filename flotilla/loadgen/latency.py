"""Latency histograms that merge across processes: log-spaced buckets, 2% wide.

A soak of 1,000 devices for ten minutes makes over half a million samples per call kind;
each worker process keeps counts per bucket instead, and the runner adds them up. A
quantile is read back as its bucket's upper bound, so it overstates by at most 2%.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

#: The smallest latency told apart (0.1 ms); anything faster shares the first bucket.
FLOOR_S = 1e-4
#: Each bucket's upper bound is this factor times its lower bound.
GROWTH = 1.02
_LOG_GROWTH = math.log(GROWTH)


def bucket_of(seconds: float) -> int:
    """The bucket a latency falls in (0 for anything up to ``FLOOR_S``)."""
    if not seconds > FLOOR_S:
        return 0
    return math.ceil(math.log(seconds / FLOOR_S) / _LOG_GROWTH)


def upper_bound_s(bucket: int) -> float:
    return FLOOR_S * GROWTH**bucket


@dataclass(slots=True)
class LatencyHistogram:
    """Counts of latencies per bucket; ``merge`` adds another histogram's."""

    counts: dict[int, int] = field(default_factory=dict)

    def add(self, seconds: float) -> None:
        b = bucket_of(seconds)
        self.counts[b] = self.counts.get(b, 0) + 1

    def merge(self, other: LatencyHistogram) -> None:
        for b, n in other.counts.items():
            self.counts[b] = self.counts.get(b, 0) + n

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def quantile_s(self, q: float) -> float:
        """The ``q`` quantile (0..1) in seconds; 0.0 when empty."""
        total = self.total
        if total == 0:
            return 0.0
        rank = max(1, math.ceil(q * total))
        seen = 0
        for b in sorted(self.counts):
            seen += self.counts[b]
            if seen >= rank:
                return upper_bound_s(b)
        return upper_bound_s(max(self.counts))  # pragma: no cover - rank <= total

    def to_json(self) -> dict[str, int]:
        return {str(b): n for b, n in sorted(self.counts.items())}

    @classmethod
    def from_json(cls, data: Mapping[str, int]) -> LatencyHistogram:
        return cls({int(b): int(n) for b, n in data.items()})
