"""Model broadcasts as compressed changes since the previous broadcast.

Server and devices must reconstruct bit-identical models (the device checks the result
against the server's SHA-256), so both sides use this one function for the arithmetic.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from flotilla.core.errors import WireError
from flotilla.core.tensors import ModelState


def apply_delta(base: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray]) -> ModelState:
    """``base + delta`` per tensor, in float32, cast back to each base tensor's dtype."""
    if set(base) != set(delta):
        raise WireError("a broadcast delta must cover exactly the model's tensors")
    out: ModelState = {}
    for name, value in base.items():
        step = np.asarray(delta[name], dtype=np.float32)
        if step.shape != value.shape:
            raise WireError(f"broadcast delta for {name!r} has shape {step.shape}")
        out[name] = (np.asarray(value, dtype=np.float32) + step).astype(value.dtype, copy=False)
    return out


def apply_average(
    base: Mapping[str, np.ndarray], average: Mapping[str, np.ndarray], server_lr: float = 1.0
) -> ModelState:
    """The next model of a server-less round: ``base + server_lr * average``.

    Agents and the server both build the model with this function from the same bytes, so
    the hash each agent reports is the hash of the checkpoint the server commits."""
    if server_lr == 1.0:
        return apply_delta(base, average)
    lr = np.float32(server_lr)
    return apply_delta(base, {k: np.asarray(v, dtype=np.float32) * lr for k, v in average.items()})
