"""FedBuff (Nguyen et al. 2022): asynchronous aggregation, a new model every K updates.

Clients train on whatever model version they fetched; an update arriving when the server
is at version ``t`` from a client that trained on ``t - tau`` has staleness ``tau``::

    buffer += n_i * s(tau_i) * delta_i          (streamed, O(model) memory)
    when K updates are buffered:
        x_{t+1} = x_t + server_lr * buffer / sum_i n_i,   t <- t + 1, buffer <- 0

With weight ``n_i = 1`` this is the paper's ``x + eta_g * (1/K) sum_i s(tau_i) delta_i``.
The staleness factor is deliberately not renormalised: stale updates count for less.

    constant    s(tau) = 1
    polynomial  s(tau) = (1 + tau)^-exponent                      (paper: exponent 0.5)
    hinge       s(tau) = 1 if tau <= hinge_b else 1 / (hinge_a * (tau - hinge_b) + 1)
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from flotilla.aggregation._kernels import apply_step
from flotilla.aggregation.base import (
    StreamingBase,
    Traits,
    positive,
    refuse_unknown,
    require,
    validate,
)
from flotilla.core.errors import UpdateRejected
from flotilla.core.tensors import ModelState, TensorSpec

STALENESS = ("constant", "polynomial", "hinge")


@dataclass(frozen=True, slots=True)
class FedBuffParams:
    """``fedbuff``."""

    #: K: updates per committed model.
    buffer_size: int = 10
    #: eta_g.
    server_lr: float = 1.0
    #: ``constant``, ``polynomial`` or ``hinge``.
    staleness: str = "polynomial"
    exponent: float = 0.5
    hinge_a: float = 10.0
    hinge_b: int = 4
    #: Updates staler than this are refused; None accepts any.
    max_staleness: int | None = None

    def __post_init__(self) -> None:
        require(self.buffer_size >= 1, "buffer_size", "an integer >= 1", self.buffer_size)
        positive("server_lr", self.server_lr)
        require(self.staleness in STALENESS, "staleness", f"one of {STALENESS}", self.staleness)
        require(self.exponent >= 0, "exponent", ">= 0", self.exponent)
        positive("hinge_a", self.hinge_a)
        require(self.hinge_b >= 0, "hinge_b", "an integer >= 0", self.hinge_b)
        ms = self.max_staleness
        require(ms is None or ms >= 0, "max_staleness", "an integer >= 0", ms)


def staleness_weight(params: FedBuffParams, tau: int) -> float:
    """s(tau) for the configured function."""
    if params.staleness == "constant":
        return 1.0
    if params.staleness == "polynomial":
        return float((1.0 + tau) ** -params.exponent)
    if tau <= params.hinge_b:
        return 1.0
    return 1.0 / (params.hinge_a * (tau - params.hinge_b) + 1.0)


class FedBuff(StreamingBase):
    """Buffered asynchronous aggregation; the engine finalizes whenever ``ready()``.

    ``begin(version, model)`` starts from a committed model; each ``finalize`` then moves
    on to its own result (version + 1) so updates keep arriving without a gap.
    """

    traits: ClassVar[Traits] = Traits(asynchronous=True)

    def __init__(self, layout: tuple[TensorSpec, ...], params: FedBuffParams | None = None):
        super().__init__(layout)
        self.params = params or FedBuffParams()

    @property
    def version(self) -> int:
        """The version of the current global model; staleness is measured against it."""
        return self._round.round

    def add(self, update: Mapping[str, np.ndarray], weight: float, staleness: int = 0) -> None:
        """Fold ``weight * s(staleness) * update``; staleness = version - trained-on version."""
        self.add_stale(update, weight, staleness)

    def add_stale(self, update: Mapping[str, np.ndarray], weight: float, staleness: int) -> None:
        """:meth:`add` with the staleness spelled out (:class:`StalenessWeighted`)."""
        self._round.open()
        try:
            tau = operator.index(staleness)
        except TypeError:
            tau = -1
        if isinstance(staleness, bool) or tau < 0:
            raise UpdateRejected(f"staleness must be an integer >= 0, got {staleness!r}")
        limit = self.params.max_staleness
        if limit is not None and tau > limit:
            raise UpdateRejected(f"update is {tau} versions stale (max_staleness={limit})")
        validate(self._layout, update, weight)
        self._sum.fold(update, weight * staleness_weight(self.params, tau), weight)

    def ready(self) -> bool:
        """True once K updates are buffered: time to finalize."""
        return self._sum.count >= self.params.buffer_size

    def finalize(self) -> ModelState:
        """Commit the buffer (full or, at a deadline, partial) and move to the new model.

        UpdateRejected (a non-finite result) drops the buffer and keeps the current model.
        """
        current = self._round.open()
        total = self._sum.total_weight
        step = self._sum.take(1.0 / total if total else 1.0)
        # A refused buffer is dropped; the current model stays open for the next updates.
        new = apply_step(current, step, self.params.server_lr)
        self._round.begin(self._round.round + 1, new)
        return new

    def state(self) -> ModelState:
        return {}

    def restore(self, state: ModelState) -> None:
        refuse_unknown(state, set(), "fedbuff")
