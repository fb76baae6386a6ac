"""A test-only digits task whose agent turns Byzantine when told so.

A task made with ``ByzantineDigits(byzantine=True)`` (an in-process fleet), or loaded by name
in an agent process started with ``FLOTILLA_TEST_BYZANTINE=1``, is Byzantine; every other
one is an honest :class:`~flotilla.tasks.digits.DigitsTask`. The attack comes from the job
(``train.params.attack``), so one fleet serves every job and ``attack = "none"`` (the
default) makes the whole fleet honest. The platform computes ``delta = local - global``
after :meth:`train` returns, so a model-poisoning attack leaves the model at
``global + malicious_delta``.

Attacks (``train.params``):

- ``gaussian``: the delta is N(0, ``sigma``^2) per coordinate (``sigma = 10``).
- ``signflip``: ``-scale`` x its own honest delta (``scale = 10``).
- ``ipm``: inner-product manipulation (Xie et al. 2020), ``-epsilon`` x an estimate of the
  honest mean delta (``epsilon = 100``).
- ``alie``: "a little is enough" (Baruch et al. 2019), ``mean - z * std`` per coordinate of
  estimated honest deltas; ``z`` defaults to the paper's formula for ``n`` and ``f``.
- ``labelflip``: trains honestly on labels ``y -> 9 - y``.

``ipm`` and ``alie`` are not omniscient: they estimate honest deltas from ``bootstrap``
(default 8) honest trainings from the current global model, each on a bootstrap sample of
the public digits training pool as large as the agent's own shard, with class proportions
drawn from Dirichlet(``data.alpha``) to mimic the honest agents' label skew. The draws are
seeded by the round, so all Byzantine agents of a round send the same vector (they collude).

Any attack may also lie about the sample count: a Byzantine agent reports
``claim_factor`` x its real count (default 1, the truth), which weighted FedAvg believes.

The Byzantine agent runs the stock client, so with ``train.update_momentum = b`` its
vector is smoothed like any delta. For ``signflip``, ``ipm``, ``alie`` and ``labelflip``
that is the same attack on momentum vectors; Gaussian noise is averaged down to a std of
about ``sigma * sqrt((1 - b) / (1 + b))`` (5.8 at b = 0.5), still ~1000x an honest norm,
and centered clipping caps any vector that far out at ``tau`` whatever its length.

Every agent, honest or not, clamps gradient elements to ``GRAD_CLAMP`` while training.
"""

from __future__ import annotations

import dataclasses
import os
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from flotilla.core.tensors import ModelState
from flotilla.tasks.base import LocalData, Shard, load_model_state, model_state
from flotilla.tasks.digits import NUM_CLASSES, DigitsTask

if TYPE_CHECKING:
    from flotilla.core.spec import DataSection, TrainSection

#: Set to ``1`` in the environment of the agent processes that are Byzantine.
BYZANTINE_ENV = "FLOTILLA_TEST_BYZANTINE"
ATTACKS = ("none", "gaussian", "signflip", "ipm", "alie", "labelflip")
#: Every agent, honest or not, clamps each gradient element to this: a model wrecked by an
#: attack then still trains to finite numbers, so FedAvg ends its rounds (badly) instead of
#: stalling on updates the server refuses as non-finite. Healthy digits gradients stay
#: well inside it.
GRAD_CLAMP = 10.0


def _clamp(grad: torch.Tensor) -> torch.Tensor:
    return grad.clamp(-GRAD_CLAMP, GRAD_CLAMP)


def alie_z(n: int, f: int) -> float:
    """Baruch et al. 2019: ``s = floor(n/2 + 1) - f``, ``z = Phi^-1((n - s) / n)``."""
    s = n // 2 + 1 - f
    return NormalDist().inv_cdf((n - s) / n)


class ByzantineDigits(DigitsTask):
    """:class:`DigitsTask`, plus the attack named in ``config.params`` on Byzantine agents."""

    def __init__(self, byzantine: bool | None = None) -> None:
        super().__init__()
        #: Given by an in-process fleet; a process reads it from its environment.
        self.byzantine = (
            os.environ.get(BYZANTINE_ENV, "") == "1" if byzantine is None else byzantine
        )
        self._shard = Shard(0, 1)
        self._alpha = 0.5

    def load_shard(self, shard: Shard, data: DataSection) -> LocalData:
        # The agent loads its shard before training whenever the job's data section
        # changes, so these are always the current job's.
        self._shard, self._alpha = shard, data.alpha
        return super().load_shard(shard, data)

    def train(
        self, model: nn.Module, data: LocalData, config: TrainSection, seed: int
    ) -> tuple[int, dict[str, float]]:
        params: dict[str, Any] = dict(config.params)
        attack = str(params.get("attack", "none"))
        if attack not in ATTACKS:
            raise ValueError(f"train.params.attack must be one of {ATTACKS}, got {attack!r}")
        if not self.byzantine or attack == "none":
            return self._fit(model, data, config, seed)
        honest = dataclasses.replace(config, params={})
        n = data.num_train
        metrics: dict[str, float] = {}
        if attack == "labelflip":
            x, y = data.train
            flipped = dataclasses.replace(data, train=(x, NUM_CLASSES - 1 - y))
            n, metrics = self._fit(model, flipped, honest, seed)
        else:
            start = model_state(model)
            delta = self._malicious_delta(attack, params, model, data, honest, seed, start)
            load_model_state(model, {k: start[k] + delta[k] for k in start})
        claimed = max(1, round(n * float(params.get("claim_factor", 1))))
        return claimed, {**metrics, "byzantine": 1.0}

    def _fit(
        self, model: nn.Module, data: LocalData, config: TrainSection, seed: int
    ) -> tuple[int, dict[str, float]]:
        """Honest digits training, with every gradient element clamped to +-GRAD_CLAMP."""
        handles = [
            p.register_hook(_clamp)  # type: ignore[no-untyped-call]
            for p in model.parameters()
        ]
        try:
            return super().train(model, data, config, seed)
        finally:
            for handle in handles:
                handle.remove()

    def _malicious_delta(
        self,
        attack: str,
        params: dict[str, Any],
        model: nn.Module,
        data: LocalData,
        config: TrainSection,
        seed: int,
        start: ModelState,
    ) -> ModelState:
        if attack == "gaussian":
            # Independent noise per agent: the shard index separates the streams.
            rng = np.random.default_rng([seed % 2**63, self._shard.index])
            sigma = float(params.get("sigma", 10.0))
            return {k: rng.normal(0.0, sigma, v.shape).astype(np.float32) for k, v in start.items()}
        if attack == "signflip":
            self._fit(model, data, config, seed)
            scale = float(params.get("scale", 10.0))
            local = model_state(model)
            return {k: -scale * (local[k] - start[k]) for k in start}
        mean, std = self._honest_estimate(start, data.num_train, config, seed, params)
        if attack == "ipm":
            epsilon = float(params.get("epsilon", 100.0))
            return {k: -epsilon * mean[k] for k in mean}
        z = params.get("z")
        z = alie_z(int(params.get("n", 10)), int(params.get("f", 2))) if z is None else float(z)
        return {k: mean[k] - z * std[k] for k in mean}

    def _honest_estimate(
        self,
        start: ModelState,
        size: int,
        config: TrainSection,
        seed: int,
        params: dict[str, Any],
    ) -> tuple[ModelState, ModelState]:
        """Per-coordinate mean and std of honest deltas, from bootstrap trainings."""
        x_pool, y_pool, _, _ = self._data()
        by_class = [np.flatnonzero(y_pool == c) for c in range(NUM_CLASSES)]
        # Seeded by the round only: every Byzantine agent draws the same samples.
        rng = np.random.default_rng([seed % 2**63, 0xB0075])
        deltas: list[ModelState] = []
        for k in range(int(params.get("bootstrap", 8))):
            counts = rng.multinomial(size, rng.dirichlet(np.full(NUM_CLASSES, self._alpha)))
            idx = np.concatenate(
                [rng.choice(members, c) for members, c in zip(by_class, counts, strict=True)]
            )
            sample = (torch.from_numpy(x_pool[idx]), torch.from_numpy(y_pool[idx]))
            local = self.build_model(0)
            load_model_state(local, start)
            self._fit(local, LocalData(train=sample, val=sample), config, seed + k + 1)
            after = model_state(local)
            deltas.append({name: after[name] - start[name] for name in start})
        mean = {k: np.mean([d[k] for d in deltas], axis=0) for k in start}
        std = {k: np.std([d[k] for d in deltas], axis=0, ddof=1) for k in start}
        return mean, std
