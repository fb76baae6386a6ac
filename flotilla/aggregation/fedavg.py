"""FedAvg (and FedProx's server side): a sample-weighted mean folded in as updates arrive.

``x_{t+1} = x_t + server_lr * sum_i(n_i * delta_i) / sum_i(n_i)``. One float32 accumulator
per tensor, so memory does not grow with the number of devices.
"""

from __future__ import annotations

from dataclasses import dataclass

from flotilla.aggregation._kernels import apply_step
from flotilla.aggregation.base import (
    StreamingBase,
    positive,
    refuse_unknown,
    require,
)
from flotilla.core.tensors import ModelState, TensorSpec


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


class FedAvg(StreamingBase):
    """Sample-weighted FedAvg over validated updates; also FedProx's server side."""

    def __init__(
        self, layout: tuple[TensorSpec, ...], params: FedAvgParams | FedProxParams | None = None
    ) -> None:
        super().__init__(layout)
        self.params = params or FedAvgParams()

    def finalize(self) -> ModelState:
        current, step = self._mean()
        return apply_step(current, step, self.params.server_lr)

    def state(self) -> ModelState:
        return {}

    def restore(self, state: ModelState) -> None:
        refuse_unknown(state, set(), "fedavg")

    def client_config(self) -> dict[str, float]:
        if isinstance(self.params, FedProxParams):
            return {"proximal_mu": self.params.mu}
        return {}
