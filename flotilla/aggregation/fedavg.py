"""Weighted FedAvg that folds each update in as it arrives: O(model) memory, any fleet size."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from flotilla.core.errors import UpdateRejected
from flotilla.core.tensors import ModelState, TensorSpec, check_finite


class StreamingFedAvg:
    """Running sample-weighted sum of deltas; ``finalize`` applies their mean to the model.

    Only one accumulator per tensor lives here, so memory does not grow with the number of
    devices. An update is validated whole before any of it is folded in, so a rejected
    update leaves the sum untouched.
    """

    def __init__(self, layout: tuple[TensorSpec, ...], server_lr: float = 1.0) -> None:
        self._layout = layout
        self._server_lr = server_lr
        self._sum: ModelState = {s.name: np.zeros(s.shape, dtype=np.float32) for s in layout}
        self._weight = 0.0
        self._count = 0
        self._finalized = False

    @property
    def count(self) -> int:
        return self._count

    @property
    def total_weight(self) -> float:
        return self._weight

    def add(self, delta: Mapping[str, np.ndarray], weight: float) -> None:
        self._check_open()
        if not weight > 0 or not np.isfinite(weight):
            raise UpdateRejected(f"update weight must be a positive number, got {weight!r}")
        for spec in self._layout:
            arr = delta.get(spec.name)
            if arr is None or tuple(arr.shape) != spec.shape:
                raise UpdateRejected(f"tensor {spec.name!r} missing or of the wrong shape")
        check_finite(delta)
        with np.errstate(over="ignore", invalid="ignore"):  # finalize refuses a non-finite sum
            for name, acc in self._sum.items():
                acc += np.asarray(delta[name], dtype=np.float32) * np.float32(weight)
        self._weight += weight
        self._count += 1

    def finalize(self, model: Mapping[str, np.ndarray]) -> ModelState:
        """``model + server_lr * weighted mean(delta)``, reusing the accumulators."""
        self._check_open()
        if self._count == 0:
            raise UpdateRejected("no updates to aggregate")
        scale = np.float32(self._server_lr / self._weight)
        out: ModelState = {}
        for name, acc in self._sum.items():
            acc *= scale
            acc += np.asarray(model[name], dtype=np.float32)
            out[name] = acc.astype(model[name].dtype, copy=False)
        self._sum = {}
        self._finalized = True
        # Finite updates can still overflow float32 when summed; never commit such a model.
        try:
            check_finite(out)
        except UpdateRejected as exc:
            raise UpdateRejected(f"the aggregate is not finite: {exc}") from exc
        return out

    def _check_open(self) -> None:
        # finalize hands its accumulators out as the new model; a second use would fold
        # into nothing and return an empty model without complaint.
        if self._finalized:
            raise RuntimeError("this aggregator was finalized; make one per round")
