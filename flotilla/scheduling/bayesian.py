"""``bayesian``: greedy+ corrected by a Gaussian process of what its predictions miss.

Greedy+ minimises a predicted cost, ``alpha * P * (U_greedy / U) ** rate + beta * F``
(:mod:`flotilla.scheduling.data_greedy`); the prediction is as good as the duration model,
and a model fed by profiles that lie, rounds that jitter and devices that throttle is wrong
in ways that depend on what a set is like (how many of its devices are unexplored, how
slow its slowest is predicted to be). This selector learns that error: a GP maps a set's
features (mean and worst predicted time, failure odds, how often its devices served,
staleness, loss, share explored, data; never who they are) to the **residual**, observed
cost minus predicted, and each round takes the candidate whose predicted cost plus a
Thompson draw of the residual is least.

The candidates are greedy+'s set, greedy+'s sets at other exchange rates and loss weights,
and sets drawn by rules that weigh speed, fairness, loss and reliability at random. With
no observations the residual is 0 everywhere and the first ``warmup_rounds`` take greedy+'s
set, so "no learning" is greedy+; exploration grows only as far as the residuals observed
vary. With ``backend = "botorch"`` (the ``bayes`` extra: BoTorch, GPyTorch) the GP is
BoTorch's ``SingleTaskGP`` with fitted hyperparameters (refitted every ``refit_every``
rounds, warm in between); by default a small exact GP with fixed hyperparameters, ~30x
cheaper per decision. The observations are the selector's state.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flotilla.core.device import DeviceProfile
from flotilla.core.errors import SpecError
from flotilla.scheduling.cost import CostModel, observed_cost, variance_added
from flotilla.scheduling.data_greedy import (
    DataGreedyParams,
    DataGreedySelector,
    DecisionInputs,
    data_ratio,
)
from flotilla.scheduling.duration import DurationModel
from flotilla.scheduling.features import DEVICE_FEATURES, device_features
from flotilla.scheduling.history import RoundOutcome

_COL = {name: i for i, name in enumerate(DEVICE_FEATURES)}
#: Columns of :func:`set_features`.
SET_FEATURES = (
    "mean_log_seconds",
    "max_log_seconds",
    "p_fail",
    "share",
    "staleness",
    "loss",
    "explored",
    "data",
)


@dataclass(frozen=True, slots=True)
class BayesianParams:
    """``bayesian``: greedy+ plus a GP of the residual of its predicted cost."""

    #: Candidate sets scored per round.
    candidates: int = 32
    #: Observations the GP keeps (the most recent).
    window: int = 128
    #: Rounds that take greedy+'s set before the GP is asked.
    warmup_rounds: int = 2
    #: ``numpy`` (a fixed-hyperparameter GP: ~0.3 ms of a decision), ``botorch`` (fitted
    #: hyperparameters; the ``bayes`` extra; ~8 ms a decision plus ~130 ms a refit and
    #: ~1 s for the first) or ``auto`` (BoTorch when installed).
    backend: str = "numpy"
    #: BoTorch: refit the GP's hyperparameters every this many observations.
    refit_every: int = 10
    #: greedy+'s knobs: the cost predicted and learned is greedy+'s.
    data_rate: float = 0.5
    loss_weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.data_rate >= 0 or not self.loss_weight >= 0:
            raise SpecError("scheduling.params: bayesian data_rate and loss_weight must be >= 0")
        if self.candidates < 2 or self.window < 2 or self.refit_every < 1:
            raise SpecError(
                "scheduling.params: bayesian needs candidates >= 2, window >= 2, refit_every >= 1"
            )
        if self.backend not in ("auto", "botorch", "numpy"):
            raise SpecError(
                f"scheduling.params.backend {self.backend!r} is not auto, botorch or numpy"
            )


def set_features(device_rows: np.ndarray) -> np.ndarray:
    """What a set of devices (rows of :func:`device_features`) is like, as one vector."""
    secs = device_rows[:, _COL["log_seconds"]]
    return np.array(
        [
            secs.mean(),
            secs.max(),
            device_rows[:, _COL["p_fail"]].mean(),
            device_rows[:, _COL["share"]].mean(),
            device_rows[:, _COL["staleness"]].mean(),
            device_rows[:, _COL["loss"]].mean(),
            device_rows[:, _COL["explored"]].mean(),
            device_rows[:, _COL["data"]].mean(),
        ],
        dtype=np.float64,
    )


class BayesianSelector:
    """Greedy+ plus a learned residual of its cost (see the module doc)."""

    def __init__(
        self,
        model: DurationModel,
        cost: CostModel,
        deadline_s: float,
        rng: random.Random,
        params: BayesianParams,
    ) -> None:
        self._model = model
        self._cost = cost
        self._deadline_s = max(deadline_s, 1e-6)
        self._rng = rng
        self._p = params
        self._gp = make_gp(params)
        self._knobs = DataGreedyParams(data_rate=params.data_rate, loss_weight=params.loss_weight)
        self._greedy_plus = DataGreedySelector(model, cost, self._knobs)
        self._x: list[list[float]] = []
        self._y: list[float] = []
        self._pending: _Pending | None = None

    def select(self, job_id: str, candidates: Sequence[DeviceProfile], count: int) -> list[str]:
        n = len(candidates)
        if n == 0 or count <= 0:
            return []
        count = min(count, n)
        gen = np.random.default_rng(self._rng.getrandbits(64))
        rows = device_features(self._model, job_id, candidates, self._deadline_s).astype(np.float64)
        knobs = self._knobs
        inputs = self._greedy_plus.inputs(
            job_id, candidates, (knobs.loss_weight, 0.0), knobs.confidence_z
        )
        variants = [knobs] + [
            DataGreedyParams(rate, weight, knobs.confidence_z)
            for rate, weight in ((0.0, knobs.loss_weight), (2 * knobs.data_rate, 0.0), (0.0, 0.0))
        ]
        choices = [self._greedy_plus.choose(job_id, candidates, count, v, inputs) for v in variants]
        drawn = candidate_sets(rows, count, self._p.candidates, gen)
        sets = _distinct([*(c.picks for c in choices), *drawn])[: self._p.candidates]
        predicted = self._predicted(inputs, sets, choices[0].greedy_utility)
        x = np.stack([set_features(rows[s]) for s in sets])
        pick = 0  # greedy+'s set
        y = np.array(self._y)
        if len(y) >= max(self._p.warmup_rounds, 2):
            draw = np.zeros(len(sets))
            if np.ptp(y) > 1e-9 * (1.0 + float(np.abs(y).max())):  # else nothing to learn
                mean, cov = self._gp.posterior(np.array(self._x), y, x)
                draw = mean + _cholesky(cov) @ gen.standard_normal(len(sets))
            pick = int(np.argmin(predicted.total + draw))
        ids = [c.device_id for c in candidates]
        self._pending = _Pending(
            job_id, x[pick], ids, float(predicted.total[pick]), float(predicted.data_ratio[pick])
        )
        return [ids[int(i)] for i in sets[pick]]

    def _predicted(
        self, inputs: DecisionInputs, sets: Sequence[np.ndarray], greedy_utility: float
    ) -> _Predicted:
        """Greedy+'s predicted cost of each set, over the deadline, as :func:`observed_cost`
        will measure it: the slowest device's time scaled by the data ratio, plus what
        the set adds to the variance of the selection counts."""
        seconds, counts = inputs.seconds, inputs.counts
        value = inputs.utility[self._knobs.loss_weight]
        ratio = data_ratio(
            np.array([value[s].sum() for s in sets]), greedy_utility, self._p.data_rate
        )
        cost = np.empty(len(sets))
        for j, s in enumerate(sets):
            picked = np.zeros(len(counts))
            picked[s] = 1.0
            pace = float(seconds[s].max())
            added = variance_added(counts, picked)
            cost[j] = self._cost.alpha * pace * ratio[j] + self._cost.beta * added
        return _Predicted(cost / self._deadline_s, ratio)

    def observe(self, outcome: RoundOutcome) -> None:
        pending, self._pending = self._pending, None
        if pending is None or pending.job_id != outcome.job_id:
            return
        cost = observed_cost(
            self._cost,
            outcome,
            self._deadline_s,
            self._model.history,
            pending.candidate_ids,
            data_ratio=pending.data_ratio,
        )
        self._x.append([float(v) for v in pending.features])
        self._y.append(cost / self._deadline_s - pending.predicted)
        del self._x[: -self._p.window], self._y[: -self._p.window]

    def state(self) -> dict[str, Any]:
        """The observations: set features and residuals (``kind`` tells them from the
        costs an earlier version kept, which are dropped on restore)."""
        return {"kind": "residual", "x": self._x, "y": self._y} if self._y else {}

    def restore(self, state: Mapping[str, Any]) -> None:
        if not state or state.get("kind") != "residual":
            return
        x, y = state.get("x", []), state.get("y", [])
        if len(x) != len(y) or any(len(row) != len(SET_FEATURES) for row in x):
            raise SpecError("bayesian selector: saved observations do not fit this selector")
        self._x = [[float(v) for v in row] for row in x]
        self._y = [float(v) for v in y]


@dataclass(frozen=True, slots=True)
class _Predicted:
    total: np.ndarray  # per set: predicted cost over the deadline
    data_ratio: np.ndarray  # per set: (U_greedy / U) ** rate


@dataclass(frozen=True, slots=True)
class _Pending:
    job_id: str
    features: np.ndarray
    candidate_ids: list[str]
    predicted: float
    data_ratio: float


def _distinct(sets: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The sets in order, each device set once (order within a set ignored)."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for s in sets:
        key = tuple(sorted(int(i) for i in s))
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def _cholesky(cov: np.ndarray) -> np.ndarray:
    """A square root of a posterior covariance, with jitter where rounding broke it."""
    jitter = 1e-9 * max(float(np.trace(cov)) / max(len(cov), 1), 1e-12)
    for _ in range(6):
        try:
            return np.linalg.cholesky(cov + jitter * np.eye(len(cov)))
        except np.linalg.LinAlgError:
            jitter *= 100.0
    values, vectors = np.linalg.eigh(cov)
    return np.asarray(vectors * np.sqrt(np.clip(values, 0.0, None)))


def candidate_sets(
    rows: np.ndarray, count: int, how_many: int, gen: np.random.Generator
) -> list[np.ndarray]:
    """Index arrays of ``count`` devices: a uniform draw, the fastest, uniform draws among
    the fastest 30-90 %, and rules weighing speed, fairness, loss and reliability at
    random, with noise of random strength."""
    n = len(rows)

    def z(col: np.ndarray) -> np.ndarray:
        return np.asarray((col - col.mean()) / (col.std() + 1e-9))

    criteria = np.stack(
        [
            -z(rows[:, _COL["log_seconds"]]),  # fast
            z(rows[:, _COL["staleness"]]) - z(rows[:, _COL["share"]]),  # rarely served
            z(rows[:, _COL["loss"]]),  # much to learn from
            -z(rows[:, _COL["p_fail"]]),  # reliable
        ],
        axis=1,
    )
    by_speed = np.argsort(-criteria[:, 0])
    sets = [gen.choice(n, size=count, replace=False), by_speed[:count]]
    # Uniform among the fastest share q: fast rounds that still spread the work.
    for q in np.linspace(0.3, 0.9, 4):
        if len(sets) >= how_many // 2:
            break
        pool = by_speed[: max(count, math.ceil(q * n))]
        sets.append(gen.choice(pool, size=count, replace=False))
    while len(sets) < how_many:
        weights = gen.dirichlet(np.ones(criteria.shape[1]))
        noise = gen.uniform(0.0, 2.0) * gen.gumbel(size=n)
        sets.append(np.argsort(-(criteria @ weights + noise))[:count])
    return sets


# --- the surrogate -------------------------------------------------------------------------


class _NumpyGP:
    """Exact GP, RBF kernel, fixed hyperparameters on standardized inputs; zero prior
    mean (no residual until one is seen) with the observed residuals' spread as scale."""

    def __init__(self, length_scale: float = 1.5, noise: float = 0.5) -> None:
        self._ell = length_scale
        self._noise = noise

    def posterior(
        self, x: np.ndarray, y: np.ndarray, cand: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Mean and covariance of the residual at ``cand``."""
        mu_x, sd_x = x.mean(axis=0), x.std(axis=0) + 1e-6
        scale = float(np.sqrt(np.mean(y * y))) + 1e-9
        xs, cs, ys = (x - mu_x) / sd_x, (cand - mu_x) / sd_x, y / scale

        def k(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            d2 = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
            return np.asarray(np.exp(-0.5 * d2 / self._ell**2))

        chol = np.linalg.cholesky(k(xs, xs) + self._noise * np.eye(len(xs)))
        k_star = k(cs, xs)
        mean = k_star @ np.linalg.solve(chol.T, np.linalg.solve(chol, ys))
        v = np.linalg.solve(chol, k_star.T)
        cov = k(cs, cs) - v.T @ v
        return scale * mean, scale * scale * (cov + cov.T) / 2.0


class _BotorchGP:
    """BoTorch's SingleTaskGP with fitted hyperparameters (the ``bayes`` extra)."""

    def __init__(self, refit_every: int) -> None:
        import botorch  # noqa: F401  (fail here, at job submission, when missing)

        self._refit_every = refit_every
        self._hyper: tuple[dict[str, Any], dict[str, Any]] | None = None
        self._fitted_at = 0

    def posterior(
        self, x: np.ndarray, y: np.ndarray, cand: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        import torch
        from botorch.fit import fit_gpytorch_mll
        from botorch.models import SingleTaskGP
        from botorch.models.transforms import Normalize, Standardize
        from gpytorch.mlls import ExactMarginalLogLikelihood  # type: ignore[import-untyped]

        gp = SingleTaskGP(
            torch.from_numpy(x),
            torch.from_numpy(y).unsqueeze(-1),
            input_transform=Normalize(x.shape[1]),
            outcome_transform=Standardize(1),
        )
        if self._hyper is None or len(y) - self._fitted_at >= self._refit_every:
            fit_gpytorch_mll(ExactMarginalLogLikelihood(gp.likelihood, gp))
            self._hyper = (gp.covar_module.state_dict(), gp.likelihood.state_dict())
            self._fitted_at = len(y)
        else:  # warm: last fit's kernel and noise on this round's data
            gp.covar_module.load_state_dict(self._hyper[0])
            gp.likelihood.load_state_dict(self._hyper[1])
        gp.eval()
        with torch.no_grad():
            post: Any = gp.posterior(torch.from_numpy(cand))
            mean = post.mean.squeeze(-1).numpy()
            cov = post.distribution.covariance_matrix.numpy()
        return np.asarray(mean, dtype=np.float64), np.asarray(cov, dtype=np.float64)


def make_gp(params: BayesianParams) -> _NumpyGP | _BotorchGP:
    backend = params.backend
    if backend == "numpy":
        return _NumpyGP()
    try:
        return _BotorchGP(params.refit_every)
    except ImportError:
        if backend == "botorch":
            raise SpecError(
                "bayesian selector: backend 'botorch' needs the bayes extra "
                "(pip install 'flotilla[bayes]')"
            ) from None
        return _NumpyGP()
