"""``bayesian``: choose among candidate device sets by a Gaussian-process model of their cost.

Each round a finite list of candidate sets is drawn (rules that weigh speed, fairness,
loss and reliability differently, with noise; plus a uniform one, the fastest one and the
greedy selector's choice).
A set is described by what its devices are like (mean and worst predicted time, failure
odds, how often they served, staleness, loss, share explored), never by who they are, so
what was learned about one set transfers to sets never tried. A GP maps those features to
the round cost ``alpha * T + beta * F`` observed after each round, and the set with the
highest log expected improvement is taken (Ament et al. 2023's LogEI, which does not
vanish numerically far from the best).

With ``backend = "botorch"`` (the ``bayes`` extra: BoTorch, GPyTorch) the GP is BoTorch's
``SingleTaskGP`` with fitted hyperparameters (refitted every ``refit_every`` rounds, warm
in between) and ``LogExpectedImprovement``; by default a small exact GP with fixed
hyperparameters on standardized data, ~30x cheaper per decision. The observations are the
selector's state.
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
from flotilla.scheduling.cost import CostModel, observed_cost
from flotilla.scheduling.duration import DurationModel
from flotilla.scheduling.features import DEVICE_FEATURES, device_features
from flotilla.scheduling.heuristics import GreedyParams, GreedySelector
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
    """``bayesian``: GP surrogate of round cost over candidate device sets."""

    #: Candidate sets scored per round.
    candidates: int = 32
    #: Observations the GP keeps (the most recent).
    window: int = 128
    #: Rounds that take a random candidate before the GP has enough to go on.
    warmup_rounds: int = 4
    #: ``numpy`` (a fixed-hyperparameter GP: ~0.3 ms a decision), ``botorch`` (fitted
    #: hyperparameters; the ``bayes`` extra; ~8 ms a decision plus ~130 ms a refit and
    #: ~1 s for the first) or ``auto`` (BoTorch when installed).
    backend: str = "numpy"
    #: BoTorch: refit the GP's hyperparameters every this many observations.
    refit_every: int = 10

    def __post_init__(self) -> None:
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
    def __init__(
        self,
        model: DurationModel,
        cost: CostModel,
        deadline_s: float,
        rng: random.Random,
        params: BayesianParams,
    ) -> None:
        if params.candidates < 2 or params.window < 2 or params.refit_every < 1:
            raise SpecError(
                "bayesian selector: need candidates >= 2, window >= 2, refit_every >= 1"
            )
        self._model = model
        self._cost = cost
        self._deadline_s = deadline_s
        self._rng = rng
        self._p = params
        self._gp = _make_gp(params)
        self._greedy = GreedySelector(model, cost, GreedyParams())
        self._x: list[list[float]] = []
        self._y: list[float] = []
        self._pending: tuple[str, np.ndarray, list[str]] | None = None

    def select(self, job_id: str, candidates: Sequence[DeviceProfile], count: int) -> list[str]:
        n = len(candidates)
        if n == 0 or count <= 0:
            return []
        count = min(count, n)
        gen = np.random.default_rng(self._rng.getrandbits(64))
        rows = device_features(self._model, job_id, candidates, self._deadline_s).astype(np.float64)
        sets = candidate_sets(rows, count, self._p.candidates - 1, gen)
        # The cost-aware greedy choice is always a candidate: the GP decides when to deviate.
        where = {c.device_id: i for i, c in enumerate(candidates)}
        greedy = self._greedy.select(job_id, candidates, count)
        sets.append(np.array([where[d] for d in greedy], dtype=np.int64))
        x = np.stack([set_features(rows[s]) for s in sets])
        if len(self._y) < self._p.warmup_rounds:
            pick = int(gen.integers(len(sets)))
        else:
            scores = self._gp.log_ei(np.array(self._x), np.array(self._y), x)
            pick = int(np.argmax(scores))
        ids = [c.device_id for c in candidates]
        self._pending = (job_id, x[pick], ids)
        return [ids[int(i)] for i in sets[pick]]

    def observe(self, outcome: RoundOutcome) -> None:
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != outcome.job_id:
            return
        _, x, ids = pending
        cost = observed_cost(self._cost, outcome, self._deadline_s, self._model.history, ids)
        self._x.append([float(v) for v in x])
        self._y.append(cost / max(self._deadline_s, 1e-6))
        del self._x[: -self._p.window], self._y[: -self._p.window]

    def state(self) -> dict[str, Any]:
        return {"x": self._x, "y": self._y} if self._y else {}

    def restore(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        x, y = state.get("x", []), state.get("y", [])
        if len(x) != len(y) or any(len(row) != len(SET_FEATURES) for row in x):
            raise SpecError("bayesian selector: saved observations do not fit this selector")
        self._x = [[float(v) for v in row] for row in x]
        self._y = [float(v) for v in y]


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
    """Exact GP, RBF kernel, fixed hyperparameters on standardized inputs and costs."""

    def __init__(self, length_scale: float = 1.5, noise: float = 0.1) -> None:
        self._ell = length_scale
        self._noise = noise

    def log_ei(self, x: np.ndarray, y: np.ndarray, cand: np.ndarray) -> np.ndarray:
        mu_x, sd_x = x.mean(axis=0), x.std(axis=0) + 1e-6
        mu_y, sd_y = y.mean(), y.std() + 1e-9
        xs, cs, ys = (x - mu_x) / sd_x, (cand - mu_x) / sd_x, (y - mu_y) / sd_y

        def k(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            d2 = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
            return np.asarray(np.exp(-0.5 * d2 / self._ell**2))

        chol = np.linalg.cholesky(k(xs, xs) + self._noise * np.eye(len(xs)))
        alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, ys))
        k_star = k(cs, xs)
        mean = k_star @ alpha
        v = np.linalg.solve(chol, k_star.T)
        sd = np.sqrt(np.clip(1.0 - (v * v).sum(0), 1e-12, None))
        # Minimizing cost: improvement over the best seen is best - f.
        return np.asarray(log_expected_improvement((ys.min() - mean) / sd) + np.log(sd))


class _BotorchGP:
    """BoTorch's SingleTaskGP and LogExpectedImprovement (the ``bayes`` extra)."""

    def __init__(self, refit_every: int) -> None:
        import botorch  # noqa: F401  (fail here, at job submission, when missing)

        self._refit_every = refit_every
        self._hyper: tuple[dict[str, Any], dict[str, Any]] | None = None
        self._fitted_at = 0

    def log_ei(self, x: np.ndarray, y: np.ndarray, cand: np.ndarray) -> np.ndarray:
        import torch
        from botorch.acquisition.analytic import LogExpectedImprovement
        from botorch.fit import fit_gpytorch_mll
        from botorch.models import SingleTaskGP
        from botorch.models.transforms import Normalize, Standardize
        from gpytorch.mlls import ExactMarginalLogLikelihood  # type: ignore[import-untyped]

        train_x = torch.from_numpy(x)
        train_y = -torch.from_numpy(y).unsqueeze(-1)  # BoTorch maximizes
        gp = SingleTaskGP(
            train_x,
            train_y,
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
        acq = LogExpectedImprovement(gp, best_f=train_y.max())
        with torch.no_grad():
            return np.asarray(acq(torch.from_numpy(cand).unsqueeze(1)).numpy())


def _make_gp(params: BayesianParams) -> _NumpyGP | _BotorchGP:
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


def log_expected_improvement(z: np.ndarray) -> np.ndarray:
    """``log(z * Phi(z) + phi(z))``, accurate far into the negative tail.

    For z < -1 it is ``log phi(z) + log(1 + z * Phi(z) / phi(z))``, the ratio taken from the
    scaled complementary error function, which loses only ~log10(z^2) digits.
    """
    from scipy.special import erfcx, log_ndtr  # type: ignore[import-untyped]

    z = np.asarray(z, dtype=np.float64)
    out = np.empty_like(z)
    log_phi = -0.5 * z * z - 0.5 * math.log(2 * math.pi)
    near = z > -1.0
    zn = z[near]
    out[near] = np.log(zn * np.exp(log_ndtr(zn)) + np.exp(log_phi[near]))
    zf = z[~near]
    mills = math.sqrt(math.pi / 2) * erfcx(-zf / math.sqrt(2))  # Phi(z) / phi(z)
    out[~near] = log_phi[~near] + np.log1p(zf * mills)
    return out
