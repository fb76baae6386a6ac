"""Selectors that rank devices by predicted time, cost or utility: FedCS, greedy and Oort.

Each reads the same :class:`DurationModel` and the pool's per-job history; none keeps state
of its own beyond what the history holds, so a restarted server that restores the history
selects as it would have. They are the baselines the learned selectors must beat.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flotilla.core.device import DeviceProfile
from flotilla.scheduling.cost import CostModel
from flotilla.scheduling.duration import DurationModel
from flotilla.scheduling.history import DeviceHistory, RoundOutcome
from flotilla.scheduling.selector import Stateless


def _ids(candidates: Sequence[DeviceProfile], picks: Sequence[int] | np.ndarray) -> list[str]:
    return [candidates[int(i)].device_id for i in picks]


@dataclass(frozen=True, slots=True)
class FedCSParams:
    """``fedcs``: Nishio & Yonetani 2019."""

    #: Devices must finish by the deadline at this many standard deviations above their
    #: predicted median time (1.28: 90 % confident).
    confidence_z: float = 1.28
    #: Share of the round's deadline the selected devices may use.
    deadline_share: float = 1.0
    #: When fewer devices are predicted to make the deadline, the next fastest fill the
    #: round up to this share of ``count`` (a round with too few devices cannot commit).
    min_share: float = 0.5


class FedCSSelector(Stateless):
    """As many devices as are predicted to finish before the deadline (up to ``count``),
    fastest first; a round may so get fewer devices than asked, as in FedCS."""

    def __init__(self, model: DurationModel, deadline_s: float, params: FedCSParams) -> None:
        self._model = model
        self._deadline_s = deadline_s * params.deadline_share
        self._p = params

    def select(self, job_id: str, candidates: Sequence[DeviceProfile], count: int) -> list[str]:
        if not candidates or count <= 0:
            return []
        seconds = self._model.predict(job_id, candidates).seconds(self._p.confidence_z)
        order = np.argsort(seconds, kind="stable")
        fit = int(np.searchsorted(seconds[order], self._deadline_s, side="right"))
        floor = max(1, math.ceil(self._p.min_share * count))
        take = min(len(order), count, max(fit, floor))
        return _ids(candidates, order[:take])

    def observe(self, outcome: RoundOutcome) -> None:
        """Learning lives in the duration model's history."""


@dataclass(frozen=True, slots=True)
class GreedyParams:
    """``greedy``: adds, one at a time, the device that raises the job's cost least."""

    #: Predicted times are taken at this many standard deviations above the median.
    confidence_z: float = 0.0


class GreedySelector(Stateless):
    """Cost-aware and fairness-aware: ``alpha * T + beta * F`` grown one device at a time.

    T only grows when a slower device is added, so once the round's pace is set, devices no
    slower than it compete on fairness alone: rarely picked ones first.
    """

    def __init__(self, model: DurationModel, cost: CostModel, params: GreedyParams) -> None:
        self._model = model
        self._cost = cost
        self._z = params.confidence_z

    def select(self, job_id: str, candidates: Sequence[DeviceProfile], count: int) -> list[str]:
        n = len(candidates)
        if n == 0 or count <= 0:
            return []
        seconds = self._model.predict(job_id, candidates).seconds(self._z)
        counts = self._model.history.selection_counts(job_id, (c.device_id for c in candidates))
        alpha, beta = self._cost.alpha, self._cost.beta
        total, squares = float(counts.sum()), float((counts * counts).sum())
        taken = np.zeros(n, dtype=bool)
        pace = 0.0
        picks = []
        for _ in range(min(count, n)):
            # Variance after adding one selection to each candidate, in O(1) per candidate.
            var = (squares + 2.0 * counts + 1.0) / n - ((total + 1.0) / n) ** 2
            cost = alpha * np.maximum(pace, seconds) + beta * var
            cost[taken] = np.inf
            i = int(np.argmin(cost))
            taken[i] = True
            picks.append(i)
            pace = max(pace, float(seconds[i]))
            total += 1.0
            squares += 2.0 * counts[i] + 1.0
            counts[i] += 1.0
        return _ids(candidates, picks)

    def observe(self, outcome: RoundOutcome) -> None:
        """Learning lives in the duration model's history."""


@dataclass(frozen=True, slots=True)
class OortParams:
    """``oort``: Lai et al., OSDI 2021 (guided participant selection)."""

    #: Share of a round given to devices never tried on this job, decaying per round to
    #: ``min_exploration``.
    exploration: float = 0.9
    exploration_decay: float = 0.98
    min_exploration: float = 0.2
    #: Exponent of the penalty on devices slower than the preferred round duration.
    straggler_penalty: float = 2.0
    #: The preferred round duration is this quantile of the candidates' predicted times.
    pacer_quantile: float = 0.5
    #: Exploited devices are drawn from those within this factor of the cut-off utility.
    cutoff: float = 0.95


class OortSelector(Stateless):
    """Statistical utility (samples x loss) times a system penalty, plus a staleness bonus.

    Devices not yet tried on the job are explored, faster ones first in expectation; the
    exploration share decays as the job learns its fleet.
    """

    def __init__(self, model: DurationModel, rng: random.Random, params: OortParams) -> None:
        self._model = model
        self._rng = rng
        self._p = params

    def select(self, job_id: str, candidates: Sequence[DeviceProfile], count: int) -> list[str]:
        n = len(candidates)
        if n == 0 or count <= 0:
            return []
        count = min(count, n)
        p = self._p
        history = self._model.history
        rounds = history.rounds.get(job_id, 0)
        seconds = self._model.predict(job_id, candidates).seconds()
        records = history.job(job_id)
        recs = [records.get(c.device_id) for c in candidates]
        explored = np.array([r is not None and r.last_loss is not None for r in recs])
        share = max(p.min_exploration, p.exploration * p.exploration_decay**rounds)
        want_new = min(round(share * count), int((~explored).sum()))
        want_known = min(count - want_new, int(explored.sum()))
        want_new = min(count - want_known, int((~explored).sum()))
        picks: list[int] = []
        if want_known:
            picks += self._exploit(recs, seconds, explored, want_known, rounds)
        if want_new:
            fresh = np.flatnonzero(~explored)
            speed = 1.0 / seconds[fresh]
            picks += list(self._draw(fresh, speed, want_new))
        return _ids(candidates, picks)

    def _exploit(
        self,
        recs: list[DeviceHistory | None],
        seconds: np.ndarray,
        explored: np.ndarray,
        want: int,
        rounds: int,
    ) -> list[int]:
        p = self._p
        known = np.flatnonzero(explored)
        stat = np.array([_loss_utility(recs[i]) for i in known])
        stat = stat / stat.max() if stat.max() > 0 else np.ones(len(known))
        last = np.array([_last_round(recs[i]) for i in known], dtype=np.float64)
        stat += np.sqrt(0.1 * math.log(max(rounds, 2)) / last)
        pace = float(np.quantile(seconds, p.pacer_quantile))
        slow = seconds[known] > pace
        stat[slow] *= (pace / seconds[known][slow]) ** p.straggler_penalty
        order = np.argsort(-stat, kind="stable")
        cut = stat[order[want - 1]] * p.cutoff
        pool = known[stat >= cut]
        return list(self._draw(pool, stat[stat >= cut], want))

    def _draw(self, pool: np.ndarray, weight: np.ndarray, want: int) -> np.ndarray:
        """``want`` of ``pool`` without replacement, with odds proportional to ``weight``."""
        gen = np.random.default_rng(self._rng.getrandbits(64))
        w = np.clip(weight, 1e-12, None)
        return gen.choice(pool, size=want, replace=False, p=w / w.sum())

    def observe(self, outcome: RoundOutcome) -> None:
        """Learning lives in the duration model's history."""


def _loss_utility(rec: DeviceHistory | None) -> float:
    """Oort's statistical utility, from what the device last reported: samples x loss."""
    if rec is None or rec.last_loss is None:
        return 0.0
    return max(rec.last_samples, 1) * max(rec.last_loss, 0.0)


def _last_round(rec: DeviceHistory | None) -> int:
    return 1 if rec is None else max(rec.last_round, 1)
