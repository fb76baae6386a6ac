"""A model-shaped update as one flat float32 vector and back: what secure aggregation masks.

Devices and the server must agree on the order without exchanging it, so it is fixed
here: tensors by name, each in C order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from flotilla.core.errors import UpdateRejected
from flotilla.core.tensors import ModelState, TensorSpec


def flatten(update: Mapping[str, np.ndarray]) -> np.ndarray:
    """The update's tensors, sorted by name, as one float32 vector."""
    parts = [np.asarray(update[name], dtype=np.float32).reshape(-1) for name in sorted(update)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


def flat_length(layout: Sequence[TensorSpec]) -> int:
    return sum(math.prod(s.shape) for s in layout)


def unflatten(vector: np.ndarray, layout: Sequence[TensorSpec]) -> ModelState:
    """``vector`` cut back into ``layout``'s tensors (float32); UpdateRejected when its
    length is not the layout's."""
    if vector.ndim != 1 or vector.size != flat_length(layout):
        raise UpdateRejected(
            f"a flat update of {vector.size} values does not fit a model of {flat_length(layout)}"
        )
    state: ModelState = {}
    at = 0
    for spec in sorted(layout, key=lambda s: s.name):
        size = math.prod(spec.shape)
        state[spec.name] = vector[at : at + size].astype(np.float32).reshape(spec.shape)
        at += size
    return state


def secure_input(
    update: Mapping[str, np.ndarray], num_samples: int, weighting: str, l2_clip: float
) -> tuple[np.ndarray, int]:
    """What a device masks in a secure round (``round_config.SecurePlan``): its update as
    one vector, first clipped to L2 norm ``l2_clip`` when that is > 0 (DP-FedAvg's clip,
    so the server's noise covers each update), and its weight: its sample count, or 1
    when the strategy is unweighted (``weighting == "one"``)."""
    vector = flatten(update)
    if l2_clip > 0:
        norm = float(np.linalg.norm(vector.astype(np.float64)))
        if norm > l2_clip:
            vector = (vector * np.float32(l2_clip / norm)).astype(np.float32)
    weight = 1 if weighting == "one" else max(int(num_samples), 1)
    return vector, weight
