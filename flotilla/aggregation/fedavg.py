"""FedAvg (and FedProx's server side): a sample-weighted mean folded in as updates arrive.

``x_{t+1} = x_t + server_lr * sum_i(n_i * delta_i) / sum_i(n_i)``. One float32 accumulator
per tensor, so memory does not grow with the number of devices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from flotilla.aggregation._kernels import apply_step, axpy
from flotilla.aggregation.base import (
    RoundGuard,
    Traits,
    WeightedSum,
    positive,
    refuse_unknown,
    require,
    validate,
)
from flotilla.core.tensors import ModelState, TensorSpec

#: Kept for callers of the first engine: ``acc += weight * arr`` without a temporary.
FOLD_BLOCK = 1 << 18


def fold_scaled(acc: np.ndarray, arr: np.ndarray, weight: np.float32) -> None:
    """``acc += weight * arr`` in place, so the product never needs a tensor-sized buffer."""
    axpy(acc, arr, float(weight))


@dataclass(frozen=True, slots=True)
class FedAvgParams:
    """``fedavg``: McMahan et al. 2017."""

    #: Multiplies the averaged update; 1.0 is plain FedAvg.
    server_lr: float = 1.0

    def __post_init__(self) -> None:
        positive("server_lr", self.server_lr)


@dataclass(frozen=True, slots=True)
class FedProxParams:
    """``fedprox``: Li et al. 2020. The server averages as FedAvg; clients add the term."""

    server_lr: float = 1.0
    #: Weight of the client's proximal term ``mu/2 * ||w - w_global||^2``.
    mu: float = 0.01

    def __post_init__(self) -> None:
        positive("server_lr", self.server_lr)
        require(self.mu >= 0.0 and self.mu < float("inf"), "mu", "a finite number >= 0", self.mu)


class FedAvg:
    """Sample-weighted FedAvg over validated updates; also FedProx's server side."""

    traits: ClassVar[Traits] = Traits()

    def __init__(
        self, layout: tuple[TensorSpec, ...], params: FedAvgParams | FedProxParams | None = None
    ) -> None:
        self.params = params or FedAvgParams()
        self._round = RoundGuard(layout)
        self._sum = WeightedSum(layout)

    @property
    def count(self) -> int:
        return self._sum.count

    @property
    def total_weight(self) -> float:
        return self._sum.total_weight

    def begin(self, round: int, global_state: ModelState) -> None:
        self._round.begin(round, global_state)
        self._sum.reset()

    def add(self, update: Mapping[str, np.ndarray], weight: float) -> None:
        self._round.open()
        validate(self._round.layout, update, weight)
        self._sum.fold(update, weight, weight)

    def finalize(self) -> ModelState:
        current = self._round.open()
        step = self._sum.take(1.0 / self._sum.total_weight if self._sum.count else 1.0)
        self._round.end()
        return apply_step(current, step, self.params.server_lr)

    def state(self) -> ModelState:
        return {}

    def restore(self, state: ModelState) -> None:
        refuse_unknown(state, set(), "fedavg")

    def client_config(self) -> dict[str, float]:
        if isinstance(self.params, FedProxParams):
            return {"proximal_mu": self.params.mu}
        return {}

    def close(self) -> None:
        self._sum.reset()
        self._round.end()


class StreamingFedAvg:
    """The first engine's one-round API: ``add`` updates, then ``finalize(model)`` once.

    Same maths and validation as :class:`FedAvg`; kept until the engine drives the
    :class:`~flotilla.aggregation.Aggregator` protocol.
    """

    def __init__(self, layout: tuple[TensorSpec, ...], server_lr: float = 1.0) -> None:
        self._layout = layout
        self._server_lr = server_lr
        self._sum = WeightedSum(layout)
        self._finalized = False

    @property
    def count(self) -> int:
        return self._sum.count

    @property
    def total_weight(self) -> float:
        return self._sum.total_weight

    def add(self, delta: Mapping[str, np.ndarray], weight: float) -> None:
        self._check_open()
        validate(self._layout, delta, weight)
        self._sum.fold(delta, weight, weight)

    def finalize(self, model: Mapping[str, np.ndarray]) -> ModelState:
        """``model + server_lr * weighted mean(delta)``, reusing the accumulators."""
        self._check_open()
        total = self._sum.total_weight
        step = self._sum.take(1.0 / total if total else 1.0)
        self._finalized = True
        return apply_step(model, step, self._server_lr)

    def _check_open(self) -> None:
        # finalize hands its accumulators out as the new model; a second use would fold
        # into nothing and return an empty model without complaint.
        if self._finalized:
            raise RuntimeError("this aggregator was finalized; make one per round")
