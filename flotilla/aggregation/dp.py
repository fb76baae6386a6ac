"""Central differential privacy: DP-FedAvg with fixed or adaptive clipping, and its accountant.

Per round, with ``m`` the denominator (``expected_clients``, else the updates received)::

    c_i   = delta_i * min(1, S / ||delta_i||_2)                  every update, unweighted
    step  = sum_i c_i / m + N(0, (z_u * S / m)^2)                per coordinate
    x_{t+1} = x_t + server_lr * step

With ``adaptive_clip`` (Andrew et al. 2021) the clip norm follows a target quantile::

    b     = (#{i: ||delta_i|| <= S} + N(0, sigma_b^2)) / m
    S    <- S * exp(-clip_learning_rate * (b - target_quantile))

and the update noise is raised to ``z_u = (z^-2 - (2 sigma_b)^-2)^-1/2`` so that the two
releases together are one Gaussian mechanism of noise multiplier ``z``. Without it,
``z_u = z``. The accountant composes one Poisson-subsampled Gaussian of multiplier ``z``
per round at the sampling rate the scheduler used (McMahan et al. 2018).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from flotilla.aggregation._kernels import apply_step, blocks, check_update, check_weight, scalar
from flotilla.aggregation._kernels import squared_norm as _sq
from flotilla.aggregation.base import (
    PartialSum,
    StreamingBase,
    Traits,
    fraction,
    positive,
    refuse_unknown,
    require,
)
from flotilla.core.errors import BudgetExhausted, SpecError, UpdateRejected
from flotilla.core.tensors import ModelState, TensorSpec

ACCOUNTANTS = ("rdp", "pld")


@dataclass(frozen=True, slots=True)
class DPParams:
    """``dp_fedavg``: DP-FedAvg (McMahan et al. 2018), adaptive clipping (Andrew et al.)."""

    #: z: noise std over sensitivity, for the whole round's release.
    noise_multiplier: float = 1.0
    #: S: L2 clip norm (the starting value when adaptive).
    clip_norm: float = 1.0
    adaptive_clip: bool = False
    #: gamma: fraction of updates meant to be unclipped.
    target_quantile: float = 0.5
    #: eta_C of the geometric clip-norm update.
    clip_learning_rate: float = 0.2
    #: sigma_b: noise std on the unclipped count; default ``expected_clients / 20``.
    clip_count_stddev: float | None = None
    #: m: the noise and mean denominator; None uses the number of updates received.
    expected_clients: int | None = None
    #: The job's budget: rounds that would take epsilon past it are refused.
    epsilon: float = 10.0
    delta: float = 1e-5
    #: ``rdp`` or ``pld`` (Google ``dp_accounting``).
    accountant: str = "rdp"
    server_lr: float = 1.0

    def __post_init__(self) -> None:
        positive("noise_multiplier", self.noise_multiplier)
        positive("clip_norm", self.clip_norm)
        fraction("target_quantile", self.target_quantile, closed_low=False)
        positive("clip_learning_rate", self.clip_learning_rate)
        m = self.expected_clients
        require(m is None or m >= 1, "expected_clients", "an integer >= 1", m)
        positive("epsilon", self.epsilon)
        fraction("delta", self.delta, closed_low=False)
        require(
            self.accountant in ACCOUNTANTS, "accountant", f"one of {ACCOUNTANTS}", self.accountant
        )
        positive("server_lr", self.server_lr)
        if self.clip_count_stddev is not None:
            positive("clip_count_stddev", self.clip_count_stddev)
        if self.adaptive_clip:
            require(
                self.clip_count_stddev is not None or m is not None,
                "clip_count_stddev",
                "set (or expected_clients set) when adaptive_clip is on",
                None,
            )
            sigma_b = self.count_stddev
            require(
                2 * sigma_b > self.noise_multiplier,
                "clip_count_stddev",
                f"> noise_multiplier / 2 = {self.noise_multiplier / 2}",
                sigma_b,
            )

    @property
    def count_stddev(self) -> float:
        if self.clip_count_stddev is not None:
            return self.clip_count_stddev
        return (self.expected_clients or 0) / 20.0

    @property
    def update_noise_multiplier(self) -> float:
        """z_u: what is left of z for the updates once the count query has its share."""
        z = self.noise_multiplier
        if not self.adaptive_clip:
            return z
        return float((z**-2 - (2 * self.count_stddev) ** -2) ** -0.5)


def dp_epsilon(
    rates: Sequence[float], noise_multiplier: float, delta: float, accountant: str = "rdp"
) -> float:
    """Epsilon at ``delta`` after one Poisson-subsampled Gaussian round per rate."""
    if not rates:
        return 0.0
    # Heavy (scipy): only DP jobs pay for the import. The package ships no type hints.
    import dp_accounting  # type: ignore[import-untyped]
    from dp_accounting.pld import pld_privacy_accountant  # type: ignore[import-untyped]
    from dp_accounting.rdp import rdp_privacy_accountant  # type: ignore[import-untyped]

    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    events = [
        dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(q, gaussian), k)
        for q, k in sorted(Counter(rates).items())
    ]
    acc: dp_accounting.PrivacyAccountant
    if accountant == "pld":
        acc = pld_privacy_accountant.PLDAccountant()
    else:
        acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(dp_accounting.ComposedDpEvent(events))
    return float(acc.get_epsilon(delta))


def _check_rate(q: float) -> None:
    if isinstance(q, bool) or not 0.0 < q <= 1.0:
        raise ValueError(f"sampling rate must be in (0, 1], got {q!r}")


class PrivacyAccountant:
    """The sampling rates of committed rounds, and the epsilon they add up to."""

    def __init__(self, noise_multiplier: float, delta: float, budget: float, kind: str) -> None:
        self.noise_multiplier = noise_multiplier
        self.delta = delta
        self.budget = budget
        self.kind = kind
        self.rates: list[float] = []
        self._epsilon = 0.0
        # (rounds, q, epsilon) of the last projection: a retried round or the spend that
        # follows a check need not run the accountant again (PLD takes seconds).
        self._projected: tuple[int, float, float] | None = None

    @property
    def epsilon(self) -> float:
        return self._epsilon

    def _with(self, q: float) -> float:
        _check_rate(q)
        q = float(q)
        if self._projected is not None and self._projected[:2] == (len(self.rates), q):
            return self._projected[2]
        eps = dp_epsilon([*self.rates, q], self.noise_multiplier, self.delta, self.kind)
        self._projected = (len(self.rates), q, eps)
        return eps

    def check(self, q: float) -> float:
        """Projected epsilon with one more round at rate ``q``; raises past the budget."""
        projected = self._with(q)
        if projected > self.budget:
            raise BudgetExhausted(
                f"round {len(self.rates) + 1} at sampling rate {q:g} would bring epsilon to "
                f"{projected:.4g} at delta={self.delta:g}, over the budget of {self.budget:g} "
                f"(spent so far: {self._epsilon:.4g} over {len(self.rates)} rounds)"
            )
        return projected

    def spend(self, q: float) -> float:
        """Count a released round; never refuses, since the model is already out."""
        self._epsilon = self._with(q)
        self.rates.append(float(q))
        return self._epsilon

    def load(self, rates: Sequence[float]) -> None:
        for q in rates:
            _check_rate(float(q))
        self.rates = [float(q) for q in rates]
        self._projected = None
        self._epsilon = dp_epsilon(self.rates, self.noise_multiplier, self.delta, self.kind)


class DPFedAvg(StreamingBase):
    """Clipped, noised, unweighted FedAvg with a privacy budget.

    Protocol: ``check_budget(q)`` before a round starts (raises BudgetExhausted),
    ``begin``/``add``/``finalize``, then ``spend()`` *before* ``state()`` is written with
    the checkpoint, so the stored history already counts the round it ships with.
    """

    traits: ClassVar[Traits] = Traits(needs_sampling_rate=True)

    def __init__(
        self,
        layout: tuple[TensorSpec, ...],
        params: DPParams | None = None,
        rng: np.random.Generator | None = None,
    ) -> None:
        self.params = p = params or DPParams()
        self.clip_norm = p.clip_norm
        self.accountant = PrivacyAccountant(p.noise_multiplier, p.delta, p.epsilon, p.accountant)
        # Fresh OS entropy unless a test injects a seeded generator; never stored.
        self._rng = rng if rng is not None else np.random.default_rng()
        super().__init__(layout)
        self._within = 0
        self._planned: float | None = None

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far, at the job's delta."""
        return self.accountant.epsilon

    def check_budget(self, q: float) -> float:
        """Refuse a round at sampling rate ``q`` that would exceed the budget; else plan it."""
        projected = self.accountant.check(q)
        self._planned = q
        return projected

    def spend(self, q: float | None = None) -> float:
        """Record a finalized round (at ``q``, default the planned rate); returns epsilon."""
        rate = q if q is not None else self._planned
        if rate is None:
            raise RuntimeError("no sampling rate: call check_budget(q) before the round")
        eps = self.accountant.spend(rate)
        self._planned = None
        return eps

    def begin(self, round: int, global_state: ModelState) -> None:
        super().begin(round, global_state)
        self._within = 0

    def add(self, update: Mapping[str, np.ndarray], weight: float) -> None:
        """Clip and fold; ``weight`` is checked but not used (DP-FedAvg is unweighted)."""
        self._round.open()
        check_weight(weight)
        check_update(self._layout, update, finite=False)
        norm = math.sqrt(sum(_sq(update[s.name]) for s in self._layout))
        if not math.isfinite(norm):  # the float64 norm is finite iff every value is
            raise UpdateRejected("the update contains NaN or Inf (or its norm overflows)")
        coef = min(1.0, self.clip_norm / norm) if norm > 0 else 1.0
        self._sum.fold(update, coef, 1.0)
        self._within += norm <= self.clip_norm

    def add_sum(self, total: Mapping[str, np.ndarray], count: int) -> None:
        """Fold the sum of ``count`` updates each clipped to ``clip_norm`` on its device
        (secure aggregation): the noise is then calibrated to ``count`` updates, as if they
        had arrived one by one. Adaptive clipping cannot run on it (it needs to know which
        updates were clipped), so such jobs are refused at submission."""
        self._round.open()
        if count < 1:
            raise UpdateRejected(f"a secure sum must hold at least one update, not {count}")
        check_update(self._layout, total, finite=True)
        self._sum.fold(total, 1.0, float(count))
        self._sum.count += count - 1
        self._within += count

    def fold_overrides(self) -> dict[str, float]:
        """Updates are clipped to the current clip norm (adaptive clipping moves it)."""
        return {"clip_norm": self.clip_norm}

    def partial(self) -> PartialSum:
        out = super().partial()
        self._within = 0
        return out

    def _tallies(self) -> dict[str, float]:
        """How many of the partial's updates were not clipped (adaptive clipping's count)."""
        return {"unclipped": float(self._within)}

    def _add_tallies(self, tallies: Mapping[str, float]) -> None:
        self._within += int(tallies.get("unclipped", 0))

    def finalize(self) -> ModelState:
        current = self._round.open()
        if self._planned is None:
            raise RuntimeError("call check_budget(q) before finalizing a private round")
        if self._sum.count == 0:
            raise UpdateRejected("no updates to aggregate")
        p = self.params
        m = p.expected_clients or self._sum.count
        std = p.update_noise_multiplier * self.clip_norm / m
        try:
            step = self._sum.take(1.0 / m)
            for buf in step.values():
                self._add_noise(buf, std)
            new = apply_step(current, step, p.server_lr)
        finally:
            self._round.end()
        if p.adaptive_clip:
            b = (self._within + self._rng.normal(0.0, p.count_stddev)) / m
            self.clip_norm *= math.exp(-p.clip_learning_rate * (b - p.target_quantile))
        return new

    def _add_noise(self, buf: np.ndarray, std: float) -> None:
        fb = buf.reshape(-1)
        tmp = np.empty(min(1 << 18, fb.size), dtype=np.float32)
        for sl in blocks(fb.size, tmp.size):
            part = tmp[: sl.stop - sl.start]
            self._rng.standard_normal(out=part, dtype=np.float32)
            part *= np.float32(std)
            fb[sl] += part

    def state(self) -> ModelState:
        return {
            "dp/clip_norm": scalar(self.clip_norm),
            "dp/sampling_rates": np.asarray(self.accountant.rates, dtype=np.float64),
        }

    def restore(self, state: ModelState) -> None:
        refuse_unknown(state, {"dp/clip_norm", "dp/sampling_rates"}, "dp_fedavg")
        if "dp/clip_norm" in state:
            clip = float(state["dp/clip_norm"])
            if not clip > 0 or not math.isfinite(clip):
                raise SpecError(f"dp/clip_norm in the stored state is {clip!r}")
            self.clip_norm = clip
        self.accountant.load(np.asarray(state.get("dp/sampling_rates", [])).reshape(-1).tolist())
