"""``tuned``: greedy+ whose knobs are learned per round, from every job's experience.

Greedy+ has knobs whose best values differ by job: how much data is worth in time (a char
LM's equal shards make it worthless, a transfer-bound job gets it nearly free) and whether
the devices' losses say anything. Learning device sets from ~40 noisy rewards cannot beat a
near-oracle greedy; learning 2 knobs of it may, and what one job learned serves the next
(measured so far: a tie with greedy+, docs/scheduling.md#results).

Each round the job picks an **arm** (a pair of knob values) by Thompson sampling from a
Bayesian linear model per arm, ``reward ~ theta_arm . context``, where the context
describes the job (:func:`job_context`: the compute share of its rounds and how widely its
devices' data differ), so an arm's record on one kind of job transfers to similar ones.
The prior puts greedy+'s defaults ahead by ``prior_lead``: with no evidence it is greedy+.

The reward of a round is the progress it made per second: the drop in the median loss
devices report (their training loss, which starts from the model they were sent, so round
``t``'s work shows in round ``t + 1``'s reports), over the round's duration, relative to the job's
recent progress (an exponential average), so the decay of a learning curve is not taken
for a bad arm. Trials live in the pool's history, committed with each job's rounds.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flotilla.core.device import DeviceProfile
from flotilla.core.errors import SpecError
from flotilla.scheduling.cost import CostModel
from flotilla.scheduling.data_greedy import DataGreedyParams, DataGreedySelector
from flotilla.scheduling.duration import DurationModel
from flotilla.scheduling.history import KnobTrial, RoundOutcome

#: Columns of :func:`job_context`.
CONTEXT = ("bias", "compute_share", "data_spread")
#: Weight of the newest round in a job's running average of progress.
_PROGRESS_DECAY = 0.3
#: Rewards are clipped to this many times the job's usual progress.
_REWARD_CLIP = 3.0


@dataclass(frozen=True, slots=True)
class TunedParams:
    """``tuned``: the arms and how sure the prior is."""

    #: Exchange rates tried (greedy+'s ``data_rate``).
    rates: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0)
    #: Loss weights tried (greedy+'s ``loss_weight``).
    loss_weights: tuple[float, ...] = (0.0, 1.0)
    #: Prior lead of greedy+'s defaults, in rewards (a round as good as usual scores 0).
    prior_lead: float = 1.0
    #: Prior spread of every coefficient, and the reward's noise.
    prior_sd: float = 0.3
    noise_sd: float = 1.0

    def __post_init__(self) -> None:
        if not self.rates or not self.loss_weights:
            raise SpecError("scheduling.params: tuned needs at least one rate and loss weight")
        if min(self.rates) < 0 or min(self.loss_weights) < 0:
            raise SpecError("scheduling.params: tuned rates and loss weights must be >= 0")
        if min(self.prior_sd, self.noise_sd) <= 0:
            raise SpecError("scheduling.params: tuned prior_sd and noise_sd must be > 0")

    def arms(self) -> list[tuple[float, float]]:
        return [(r, w) for r in self.rates for w in self.loss_weights]


def job_context(
    model: DurationModel, job_id: str, candidates: Sequence[DeviceProfile]
) -> tuple[float, ...]:
    """What kind of job this is, in the columns of :data:`CONTEXT`."""
    shares = [
        rec.compute_s / (rec.compute_s + rec.transfer_s)
        for rec in model.history.job(job_id).values()
        if rec.delivered and rec.compute_s + rec.transfer_s > 0
    ]
    samples = model.samples(job_id, candidates)
    known = samples[samples > 0]
    spread = float(np.std(np.log(known))) if known.size > 1 else 0.0
    return (1.0, statistics.median(shares) if shares else 0.5, min(spread, 3.0))


@dataclass(slots=True)
class _Pending:
    """The round whose reward is still to come: its knobs, context, loss and length."""

    round: int
    knobs: tuple[float, ...]
    context: tuple[float, ...]
    loss: float | None = None
    seconds: float | None = None


class TunedSelector:
    """Greedy+ with knobs chosen by a contextual Thompson-sampling bandit (module doc)."""

    def __init__(
        self,
        model: DurationModel,
        cost: CostModel,
        rng: random.Random,
        params: TunedParams,
    ) -> None:
        self._model = model
        self._greedy_plus = DataGreedySelector(model, cost, DataGreedyParams())
        self._gen = np.random.default_rng(rng.getrandbits(64))
        self.params = params
        self._arms = params.arms()
        self._default = _nearest(self._arms, DataGreedyParams())
        self._pending: dict[str, list[_Pending]] = {}
        self._progress: dict[str, float] = {}

    # --- choosing -------------------------------------------------------------------------

    def select(self, job_id: str, candidates: Sequence[DeviceProfile], count: int) -> list[str]:
        if not candidates or count <= 0:
            return []
        context = job_context(self._model, job_id, candidates)
        rate, loss_weight = self._arms[self.draw(context)]
        knobs = DataGreedyParams(data_rate=rate, loss_weight=loss_weight)
        choice = self._greedy_plus.choose(job_id, candidates, count, knobs)
        round_no = self._model.history.rounds.get(job_id, 0) + 1
        # A retried round replaces its earlier try.
        pending = [p for p in self._pending.get(job_id, []) if p.round != round_no]
        self._pending[job_id] = [*pending, _Pending(round_no, (rate, loss_weight), context)]
        return [candidates[int(i)].device_id for i in choice.picks]

    def draw(self, context: Sequence[float]) -> int:
        """An arm by Thompson sampling: each arm's coefficients drawn from its posterior."""
        z = np.asarray(context, dtype=np.float64)
        best, best_value = 0, -math.inf
        for arm, (mean, cov) in enumerate(self.posteriors()):
            theta = self._gen.multivariate_normal(mean, cov)
            value = float(theta @ z)
            if value > best_value:
                best, best_value = arm, value
        return best

    def posteriors(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per arm: the posterior mean and covariance of its coefficients, from every job's
        trials (Bayesian linear regression, Gaussian prior)."""
        p = self.params
        by_arm: dict[int, list[KnobTrial]] = {}
        for trial in self._model.history.all_trials():
            arm = _index(self._arms, trial.knobs)
            if arm is not None and len(trial.context) == len(CONTEXT):
                by_arm.setdefault(arm, []).append(trial)
        out = []
        for arm in range(len(self._arms)):
            prior_mean = np.zeros(len(CONTEXT))
            prior_mean[0] = p.prior_lead if arm == self._default else 0.0
            precision = np.eye(len(CONTEXT)) / p.prior_sd**2
            moment = prior_mean / p.prior_sd**2
            trials = by_arm.get(arm, [])
            if trials:
                z = np.array([t.context for t in trials])
                r = np.array([t.reward for t in trials])
                precision = precision + z.T @ z / p.noise_sd**2
                moment = moment + z.T @ r / p.noise_sd**2
            cov = np.linalg.inv(precision)
            out.append((cov @ moment, (cov + cov.T) / 2.0))
        return out

    # --- learning -------------------------------------------------------------------------

    def observe(self, outcome: RoundOutcome) -> None:
        """Close the books of the round before this one: its progress shows in the losses
        reported now."""
        job_id = outcome.job_id
        pending = self._pending.get(job_id, [])
        mine = next((p for p in pending if p.round == outcome.round), None)
        if mine is not None:
            mine.loss = _median_loss(outcome)
            times = list(outcome.durations.values())
            mine.seconds = max(times) if times else None
        earlier = next((p for p in pending if p.round == outcome.round - 1), None)
        if earlier is not None and mine is not None:
            self._reward(job_id, earlier, mine.loss)
        self._pending[job_id] = [p for p in pending if p.round >= outcome.round]

    def _reward(self, job_id: str, done: _Pending, loss_after: float | None) -> None:
        if done.loss is None or loss_after is None or not done.seconds:
            return
        progress = (done.loss - loss_after) / done.seconds
        usual = self._progress.get(job_id)
        self._progress[job_id] = (
            abs(progress)
            if usual is None
            else (1 - _PROGRESS_DECAY) * usual + _PROGRESS_DECAY * abs(progress)
        )
        if not usual:
            return  # the first progress only sets the scale
        reward = float(np.clip(progress / usual - 1.0, -_REWARD_CLIP, _REWARD_CLIP))
        self._model.history.add_trial(
            job_id, KnobTrial(done.round, done.knobs, done.context, reward)
        )

    # --- state ----------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Per job: the running scale of progress and the rounds awaiting their reward (the
        trials themselves are committed with the pool's history)."""
        return {
            "progress": dict(self._progress),
            "pending": {
                job: [[p.round, list(p.knobs), list(p.context), p.loss, p.seconds] for p in rounds]
                for job, rounds in self._pending.items()
            },
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        self._progress = {str(k): float(v) for k, v in state.get("progress", {}).items()}
        self._pending = {
            str(job): [
                _Pending(int(r), tuple(k), tuple(c), loss, seconds)
                for r, k, c, loss, seconds in rounds
            ]
            for job, rounds in state.get("pending", {}).items()
        }


def _median_loss(outcome: RoundOutcome) -> float | None:
    losses = [v for v in outcome.losses.values() if math.isfinite(v)]
    return statistics.median(losses) if losses else None


def _index(arms: Sequence[tuple[float, float]], knobs: Sequence[float]) -> int | None:
    for i, arm in enumerate(arms):
        if len(knobs) == 2 and math.isclose(arm[0], knobs[0]) and math.isclose(arm[1], knobs[1]):
            return i
    return None


def _nearest(arms: Sequence[tuple[float, float]], default: DataGreedyParams) -> int:
    """The arm closest to greedy+'s defaults: where a fleet with no evidence starts."""
    return min(
        range(len(arms)),
        key=lambda i: abs(arms[i][0] - default.data_rate) + abs(arms[i][1] - default.loss_weight),
    )
