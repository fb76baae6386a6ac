"""Server optimizers over the FedAvg pseudo-gradient: FedAvgM, FedAdam, FedYogi, FedAdagrad.

Each round's ``delta_t`` is the sample-weighted mean of the updates (streamed, as FedAvg).
The optimizer state is model-sized and persists across rounds through ``state()``.

FedAvgM (Hsu et al. 2019, with the sign flipped so ``delta`` points downhill)::

    v_t = momentum * v_{t-1} + delta_t           v_0 = 0
    x_{t+1} = x_t + server_lr * v_t

FedAdam / FedYogi / FedAdagrad (Reddi et al. 2021, Algorithm 2; no bias correction)::

    m_t = beta1 * m_{t-1} + (1 - beta1) * delta_t                    m_0 = 0
    v_t = v_{t-1} + delta_t^2                                        (adagrad)
    v_t = v_{t-1} - (1 - beta2) * delta_t^2 * sign(v_{t-1} - delta_t^2)   (yogi)
    v_t = beta2 * v_{t-1} + (1 - beta2) * delta_t^2                  (adam)
    x_{t+1} = x_t + eta * m_t / (sqrt(v_t) + tau)                    v_0 = tau^2

Finalize runs twice over the model in blocks: first to check that the new model and state
are finite, then to write them. A refused round therefore leaves the moments untouched,
without a second model-sized copy of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from flotilla.aggregation._kernels import blocks, scalar
from flotilla.aggregation.base import (
    StreamingBase,
    fraction,
    positive,
    refuse_unknown,
    require,
    restore_tensors,
    tensor_state,
)
from flotilla.core.errors import SpecError, UpdateRejected
from flotilla.core.tensors import ModelState, TensorSpec

Rule = Literal["adam", "yogi", "adagrad"]
RULES: tuple[Rule, ...] = ("adam", "yogi", "adagrad")


@dataclass(frozen=True, slots=True)
class FedAvgMParams:
    """``fedavgm``. The steady-state step is ``server_lr / (1 - momentum)`` times the mean
    update, so the defaults move as far per round as FedAvg, with the noise smoothed."""

    server_lr: float = 0.1
    momentum: float = 0.9

    def __post_init__(self) -> None:
        positive("server_lr", self.server_lr)
        fraction("momentum", self.momentum)


@dataclass(frozen=True, slots=True)
class FedOptParams:
    """``fedadam``, ``fedyogi``, ``fedadagrad`` (adagrad ignores ``beta2``)."""

    #: Server learning rate (Reddi et al.'s eta).
    eta: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.99
    #: Adaptivity: added to sqrt(v) and the square root of the initial v.
    tau: float = 1e-3

    def __post_init__(self) -> None:
        positive("eta", self.eta)
        fraction("beta1", self.beta1)
        fraction("beta2", self.beta2)
        positive("tau", self.tau)


def _finite(*arrays: np.ndarray) -> None:
    """Blocks are float64; what is stored is float32, where finite may overflow."""
    for arr in arrays:
        with np.errstate(over="ignore"):
            ok = np.isfinite(arr.astype(np.float32)).all()
        if not ok:
            raise UpdateRejected("the aggregate is not finite (server optimizer step)")


def _out(current: np.ndarray, buf: np.ndarray) -> np.ndarray:
    return buf.reshape(np.shape(current)).astype(np.asarray(current).dtype, copy=False)


class FedAvgM(StreamingBase):
    """FedAvg with server momentum (Hsu et al. 2019)."""

    def __init__(self, layout: tuple[TensorSpec, ...], params: FedAvgMParams | None = None):
        super().__init__(layout)
        self.params = params or FedAvgMParams()
        self._v: ModelState | None = None

    def finalize(self) -> ModelState:
        current, delta = self._mean()
        if self._v is None:
            self._v = {s.name: np.zeros(s.shape, dtype=np.float32) for s in self._layout}
        beta, lr = self.params.momentum, self.params.server_lr
        for commit in (False, True):
            for name, d in delta.items():
                fd, fv = d.reshape(-1), self._v[name].reshape(-1)
                fx = np.asarray(current[name]).reshape(-1)
                for sl in blocks(fd.size):
                    with np.errstate(over="ignore", invalid="ignore"):
                        v = beta * fv[sl].astype(np.float64) + fd[sl]
                        x = fx[sl] + lr * v
                    if commit:
                        fv[sl] = v
                        fd[sl] = x
                    else:
                        _finite(v, x)
        return {name: _out(current[name], d) for name, d in delta.items()}

    def state(self) -> ModelState:
        return tensor_state("fedavgm/v", self._v) if self._v is not None else {}

    def restore(self, state: ModelState) -> None:
        refuse_unknown(state, {f"fedavgm/v/{s.name}" for s in self._layout}, "fedavgm")
        self._v = restore_tensors("fedavgm/v", self._layout, state)


class FedOpt(StreamingBase):
    """FedAdam, FedYogi or FedAdagrad (Reddi et al. 2021, Algorithm 2)."""

    def __init__(
        self, layout: tuple[TensorSpec, ...], rule: Rule, params: FedOptParams | None = None
    ) -> None:
        if rule not in RULES:
            raise SpecError(f"rule must be one of {list(RULES)}, got {rule!r}")
        super().__init__(layout)
        self.rule = rule
        self.params = params or FedOptParams()
        self.rounds = 0
        self._m: ModelState | None = None
        self._v: ModelState | None = None

    @property
    def _name(self) -> str:
        return f"fed{self.rule}"

    def finalize(self) -> ModelState:
        current, delta = self._mean()
        p = self.params
        if self._m is None or self._v is None:
            self._m = {s.name: np.zeros(s.shape, dtype=np.float32) for s in self._layout}
            self._v = {s.name: np.full(s.shape, p.tau**2, dtype=np.float32) for s in self._layout}
        for commit in (False, True):
            for name, d in delta.items():
                fd, fx = d.reshape(-1), np.asarray(current[name]).reshape(-1)
                fm, fv = self._m[name].reshape(-1), self._v[name].reshape(-1)
                for sl in blocks(fd.size):
                    m, v, x = self._block(fd[sl], fm[sl], fv[sl], fx[sl])
                    if commit:
                        fm[sl], fv[sl], fd[sl] = m, v, x
                    else:
                        _finite(m, v, x)
        self.rounds += 1
        return {name: _out(current[name], d) for name, d in delta.items()}

    def _block(
        self, d32: np.ndarray, m0: np.ndarray, v0: np.ndarray, x0: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One block of Algorithm 2 in float64; the stored state stays float32."""
        p = self.params
        with np.errstate(over="ignore", invalid="ignore"):
            d = d32.astype(np.float64)
            v_prev = v0.astype(np.float64)
            m = p.beta1 * m0 + (1.0 - p.beta1) * d
            d2 = d * d
            if self.rule == "adagrad":
                v = v_prev + d2
            elif self.rule == "yogi":
                v = v_prev - (1.0 - p.beta2) * d2 * np.sign(v_prev - d2)
            else:
                v = p.beta2 * v_prev + (1.0 - p.beta2) * d2
            x = x0 + p.eta * m / (np.sqrt(v) + p.tau)
        return m, v, x

    def state(self) -> ModelState:
        out: ModelState = {f"{self._name}/rounds": scalar(self.rounds)}
        if self._m is not None and self._v is not None:
            out.update(tensor_state(f"{self._name}/m", self._m))
            out.update(tensor_state(f"{self._name}/v", self._v))
        return out

    def restore(self, state: ModelState) -> None:
        keys = {f"{self._name}/rounds"}
        for part in ("m", "v"):
            keys |= {f"{self._name}/{part}/{s.name}" for s in self._layout}
        refuse_unknown(state, keys, self._name)
        m = restore_tensors(f"{self._name}/m", self._layout, state)
        v = restore_tensors(f"{self._name}/v", self._layout, state)
        require((m is None) == (v is None), f"{self._name} state", "m and v together", "one")
        rounds = state.get(f"{self._name}/rounds")
        self.rounds = int(rounds) if rounds is not None else 0
        self._m, self._v = m, v
