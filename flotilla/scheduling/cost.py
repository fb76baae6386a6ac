"""A job's scheduling cost, ``alpha * T + beta * F`` (Zhou et al., AAAI 2022), and fairness.

T is the round's predicted time (its slowest selected device); F the variance of how often
each device has been selected for the job, so spreading work lowers it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flotilla.scheduling.history import FleetHistory, RoundOutcome


@dataclass(frozen=True, slots=True)
class CostModel:
    alpha: float = 1.0
    beta: float = 3000.0

    def cost(self, round_seconds: float, counts_after: np.ndarray) -> float:
        """Cost of a round of ``round_seconds`` that leaves selection counts ``counts_after``."""
        return self.alpha * round_seconds + self.beta * selection_variance(counts_after)


def observed_cost(
    cost: CostModel,
    outcome: RoundOutcome,
    deadline_s: float,
    history: FleetHistory,
    candidate_ids: Sequence[str],
    data_ratio: float = 1.0,
) -> float:
    """A closed round's actual cost, for selectors that learn from it.

    T is its slowest delivered device, and each device that failed counts as a
    deadline-long wait spread over the round. F is what this round added to the variance
    of the candidates' selection counts: the job's total F reflects every earlier round,
    which this round's choice can no longer change. ``data_ratio`` scales the time as
    greedy+ does (``(U_greedy / U) ** rate``: a round with more useful data may take longer).
    """
    times = list(outcome.durations.values())
    slowest = max(times) if times else deadline_s
    failed = len(outcome.failures) / max(len(outcome.selected) or len(times), 1)
    after = history.selection_counts(outcome.job_id, candidate_ids)
    picked = set(outcome.selected)
    mask = np.array([d in picked for d in candidate_ids], dtype=np.float64)
    added = variance_added(after - mask, mask)
    return cost.alpha * (slowest + failed * deadline_s) * data_ratio + cost.beta * added


def variance_added(before: np.ndarray, picked: np.ndarray) -> float:
    """What one more selection of the ``picked`` devices (a 0/1 mask over ``before``) adds
    to the variance of the selection counts ``before``: a round's F."""
    return selection_variance(before + picked) - selection_variance(before)


def selection_variance(counts: np.ndarray) -> float:
    return float(np.var(counts)) if len(counts) else 0.0


def jain_index(counts: np.ndarray) -> float:
    """``(sum x)^2 / (n sum x^2)``: 1 when every device did equal work, 1/n when one did all."""
    x = np.asarray(counts, dtype=np.float64)
    sq = float(np.sum(x * x))
    return float(np.sum(x)) ** 2 / (len(x) * sq) if sq > 0 else 1.0
