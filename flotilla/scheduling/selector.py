"""The selection seam: which idle devices a job's round gets."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from flotilla.core.device import DeviceProfile
from flotilla.scheduling.history import RoundOutcome


class Selector(Protocol):
    """Chooses up to ``count`` devices from ``candidates`` for one round of one job."""

    def select(self, job_id: str, candidates: Sequence[DeviceProfile], count: int) -> list[str]: ...

    def observe(self, outcome: RoundOutcome) -> None: ...

    def state(self) -> dict[str, Any]:
        """What the selector learned (plain JSON data), committed with each round."""
        ...

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take back what :meth:`state` returned, when a job resumes."""
        ...


class Stateless:
    """For selectors whose only evidence is the pool's history, committed by the engine."""

    def state(self) -> dict[str, Any]:
        return {}

    def restore(self, state: Mapping[str, Any]) -> None:
        return None


@dataclass(frozen=True, slots=True)
class RandomParams:
    """``random``: no parameters."""


class RandomSelector(Stateless):
    """Uniform sampling without replacement; the baseline every learned selector must beat."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(self, job_id: str, candidates: Sequence[DeviceProfile], count: int) -> list[str]:
        ids = [c.device_id for c in candidates]
        return self._rng.sample(ids, min(count, len(ids)))

    def observe(self, outcome: RoundOutcome) -> None:
        """Uniform sampling learns nothing."""
