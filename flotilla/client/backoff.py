"""Retry pacing for the agent: capped exponential backoff with jitter."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(slots=True)
class Backoff:
    """Capped exponential backoff with "equal jitter" (a delay drawn from the upper half of
    the current ceiling), so a fleet does not reconnect in step yet never retries at once."""

    rng: random.Random
    base_s: float = 0.25
    cap_s: float = 10.0
    attempt: int = 0

    def next_delay(self) -> float:
        ceiling = min(self.cap_s, self.base_s * 2**self.attempt)
        self.attempt += 1
        return self.rng.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self.attempt = 0
