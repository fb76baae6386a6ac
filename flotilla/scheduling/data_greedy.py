"""``greedy+``: greedy's pace and fairness, but the round's data counts too.

Greedy minimises ``alpha * T + beta * F`` and so leans to small shards, which are fast;
yet how far a round moves the model depends on the data it trains on: each device's
update grows with its local steps (its samples, for a fixed batch size and epochs) and with
how much it still has to learn (its loss). So a set's **utility** is the sum over its
devices of ``samples x loss`` (Oort's statistical utility): the useful samples the round
trains on. (Its sample-weighted mean, how aggregation weighs the updates, overrates a set
that one large shard dominates, and measured no better.)

Every pace ``P`` a round could run at (the candidates' predicted times) proposes one set:
the devices that fit it, least picked first as greedy's fairness wants and, among equals,
the most useful. The pace chosen minimises

    alpha * P * (U_greedy / U) ** rate + beta * F

where ``U`` is the set's utility and ``U_greedy`` that of greedy's set (the one that
minimises ``alpha * P + beta * F``). ``rate`` is the exchange rate, explicit: a round whose
utility is ``x`` times greedy's moves the model ``x ** rate`` times as far, so it may take
that much longer. With ``rate = 0`` this is greedy's cost. Stateless: everything comes from
the pool's history.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from flotilla.core.device import DeviceProfile
from flotilla.scheduling.cost import CostModel
from flotilla.scheduling.duration import DurationModel
from flotilla.scheduling.history import RoundOutcome
from flotilla.scheduling.selector import Stateless


@dataclass(frozen=True, slots=True)
class DataGreedyParams:
    """``greedy+``: the knobs a tuner may turn (docs/scheduling.md)."""

    #: Data-for-time exchange rate (see the module doc): 0 is greedy's cost; 0.5 says a
    #: round's progress grows with the square root of its useful data.
    data_rate: float = 0.5
    #: Exponent of a device's last loss (relative to the candidates' mean) in its utility:
    #: 0 counts samples only.
    loss_weight: float = 1.0
    #: Predicted times are taken at this many standard deviations above the median.
    confidence_z: float = 0.0
    #: ``variance``: greedy's fairness, every selection above the mean costs. ``budget``:
    #: a device may fall ``budget`` selections behind the average candidate for free; only
    #: what it is owed beyond that counts, as greedy's variance would charge it.
    fairness: str = "variance"
    budget: float = 1.0

    def __post_init__(self) -> None:
        if not self.data_rate >= 0 or not self.loss_weight >= 0:
            raise ValueError("data_rate and loss_weight must be >= 0")
        if self.fairness not in ("variance", "budget") or not self.budget >= 0:
            raise ValueError("fairness must be 'variance' or 'budget', budget >= 0")


@dataclass(frozen=True, slots=True)
class PaceChoice:
    """One decision: the chosen devices (candidate positions), its pace, and the pace and
    utility of greedy's set (the one that minimises ``alpha * P + beta * F``)."""

    picks: np.ndarray
    pace_s: float
    greedy_pace_s: float
    greedy_utility: float


@dataclass(frozen=True, slots=True)
class DecisionInputs:
    """What a decision reads from the time model and the history, read once for every
    set of knobs a caller tries (predicting a fleet's times is most of a decision's CPU)."""

    seconds: np.ndarray
    counts: np.ndarray
    #: Per loss weight: each candidate's utility (:func:`utility`).
    utility: Mapping[float, np.ndarray]


class DataGreedySelector(Stateless):
    """Greedy with data utility among devices that fit the pace (see the module doc)."""

    def __init__(self, model: DurationModel, cost: CostModel, params: DataGreedyParams) -> None:
        self._model = model
        self._cost = cost
        self.params = params

    def select(self, job_id: str, candidates: Sequence[DeviceProfile], count: int) -> list[str]:
        if not candidates or count <= 0:
            return []
        choice = self.choose(job_id, candidates, count, self.params)
        return [candidates[int(i)].device_id for i in choice.picks]

    def inputs(
        self,
        job_id: str,
        candidates: Sequence[DeviceProfile],
        loss_weights: Iterable[float],
        confidence_z: float = 0.0,
    ) -> DecisionInputs:
        """Predicted times (at ``confidence_z``), selection counts and utilities."""
        model = self._model
        return DecisionInputs(
            model.predict(job_id, candidates).seconds(confidence_z),
            model.history.selection_counts(job_id, (c.device_id for c in candidates)),
            {w: utility(model, job_id, candidates, w) for w in set(loss_weights)},
        )

    def choose(
        self,
        job_id: str,
        candidates: Sequence[DeviceProfile],
        count: int,
        params: DataGreedyParams,
        inputs: DecisionInputs | None = None,
    ) -> PaceChoice:
        """The decision with ``params`` (a tuner may pass other knobs than its own), from
        ``inputs`` when given (read at ``params.confidence_z``, with its loss weight)."""
        if inputs is None:
            inputs = self.inputs(job_id, candidates, (params.loss_weight,), params.confidence_z)
        n = len(candidates)
        k = min(count, n)
        seconds, counts = inputs.seconds, inputs.counts
        value = inputs.utility[params.loss_weight]
        if params.fairness == "budget":
            # Deficit queues: what each device is owed beyond its budget; owed most first.
            owed = np.maximum(float(counts.mean()) - counts - params.budget, 0.0)
            first, charge = -owed, -2.0 * owed
        else:
            # Greedy's: what a selection adds to the variance of the counts (the rest of
            # the variance is the same for every set of k devices); least picked first.
            first, charge = counts, 2.0 * counts + 1.0
        # Fairness first, then the most useful, then the fastest.
        rank = np.empty(n, dtype=np.int64)
        rank[np.lexsort((seconds, -value, first))] = np.arange(n)
        sets = _PaceSets(seconds, rank, k)
        fairness = self._cost.beta * sets.total(charge) / n
        time_cost = self._cost.alpha * sets.paces
        base = int(np.argmin(time_cost + fairness))
        data = sets.total(value)
        per_progress = time_cost * data_ratio(data, float(data[base]), params.data_rate)
        best = int(np.argmin(per_progress + fairness))
        return PaceChoice(
            sets.members(best), float(sets.paces[best]), float(sets.paces[base]), float(data[base])
        )

    def observe(self, outcome: RoundOutcome) -> None:
        """Learning lives in the duration model's history."""


def data_ratio(set_utility: np.ndarray | float, greedy_utility: float, rate: float) -> np.ndarray:
    """``(U_greedy / U) ** rate``: the factor by which a round's time counts less for the
    useful data it trains on (1 for greedy's own set, and for any set at ``rate = 0``)."""
    return np.asarray(
        (max(greedy_utility, 1e-12) / np.maximum(set_utility, 1e-12)) ** rate, dtype=np.float64
    )


def utility(
    model: DurationModel, job_id: str, candidates: Sequence[DeviceProfile], loss_weight: float
) -> np.ndarray:
    """Per candidate: its samples times its last loss, to ``loss_weight``. A loss is taken
    relative to the mean loss of the round it was reported in (early rounds report high
    losses from every device: that says when, not who), and a device not yet heard from
    counts as that mean."""
    samples = model.filled_samples(job_id, candidates)
    if loss_weight == 0:
        return samples
    records = model.history.job(job_id)
    by_round: dict[int, list[float]] = {}
    for past in records.values():
        if past.last_loss is not None and past.last_loss >= 0:
            by_round.setdefault(past.last_round, []).append(past.last_loss)
    means = {r: float(np.mean(v)) for r, v in by_round.items()}
    ratio = np.ones(len(candidates))
    for i, c in enumerate(candidates):
        rec = records.get(c.device_id)
        if rec is None or rec.last_loss is None or rec.last_loss < 0:
            continue
        mean = means[rec.last_round]
        ratio[i] = rec.last_loss / mean if mean > 0 else 1.0
    return np.asarray(samples * np.clip(ratio, 0.25, 4.0) ** loss_weight)


class _PaceSets:
    """The set each pace proposes: the ``k`` best-ranked devices no slower than it.

    Sweeping the devices from fastest to slowest, each that outranks the worst of the
    current set replaces it, and the set so formed runs at that device's pace (a device
    that does not get in only makes the same set slower, so it proposes nothing).
    O(n log k) per decision.
    """

    def __init__(self, seconds: np.ndarray, rank: np.ndarray, k: int) -> None:
        self._rank = rank
        self._k = k
        self._by_time = np.argsort(seconds, kind="stable")
        #: Per proposed set: the device that completed it and the one it replaced (-1).
        joined: list[int] = []
        left: list[int] = []
        worst: list[tuple[int, int]] = []  # heap of (-rank, device)
        for i in self._by_time.tolist():
            out = -1
            if len(worst) == k:
                if rank[i] > -worst[0][0]:
                    continue
                out = heapq.heappushpop(worst, (-int(rank[i]), i))[1]
            else:
                heapq.heappush(worst, (-int(rank[i]), i))
            if len(worst) == k:
                joined.append(i)
                left.append(out)
        self._joined = np.array(joined, dtype=np.int64)
        self._left = np.array(left, dtype=np.int64)
        self.paces = seconds[self._joined]

    def total(self, per_device: np.ndarray) -> np.ndarray:
        """``sum(per_device)`` over each proposed set."""
        first = float(per_device[self.members(0)].sum())
        change = per_device[self._joined] - np.where(self._left >= 0, per_device[self._left], 0.0)
        change[0] = first
        return np.cumsum(change)

    def members(self, index: int) -> np.ndarray:
        """The devices (candidate positions) of proposed set ``index``."""
        chosen = set(self._by_time[: self._k].tolist())  # until the set is full, all join
        for joined, left in zip(
            self._joined[1 : index + 1], self._left[1 : index + 1], strict=True
        ):
            chosen.discard(int(left))
            chosen.add(int(joined))
        return np.array(sorted(chosen), dtype=np.int64)
