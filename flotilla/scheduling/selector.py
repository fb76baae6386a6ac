"""The selection seam: which idle devices a job's round gets."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from flotilla.core.device import DeviceProfile
from flotilla.scheduling.history import RoundOutcome


class Selector(Protocol):
    """Chooses up to ``count`` devices from ``candidates`` for one round of one job."""

    def select(self, job_id: str, candidates: Sequence[DeviceProfile], count: int) -> list[str]: ...

    def observe(self, outcome: RoundOutcome) -> None: ...


@dataclass(frozen=True, slots=True)
class RandomParams:
    """``random``: no parameters."""


class RandomSelector:
    """Uniform sampling without replacement; the baseline every learned selector must beat."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(self, job_id: str, candidates: Sequence[DeviceProfile], count: int) -> list[str]:
        ids = [c.device_id for c in candidates]
        return self._rng.sample(ids, min(count, len(ids)))

    def observe(self, outcome: RoundOutcome) -> None:
        """Uniform sampling learns nothing."""
