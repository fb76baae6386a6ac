"""Clip, quantize with stochastic rounding, weight; and the exact way back to a mean.

A device sends w*q (q in [0, 2**b - 1]) with w appended, so the server's unmasked sum is
sum_i w_i*q_i and sum_i w_i: the weighted mean without any single update."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from flotilla.secagg.config import SecAggConfig


def levels(config: SecAggConfig) -> int:
    return (1 << config.quantization_bits) - 1


def quantize(
    update: np.ndarray, config: SecAggConfig, randbytes: Callable[[int], bytes]
) -> np.ndarray:
    """uint64 integers in [0, 2**b - 1]: E[q] is the clipped value's position on the grid.

    Randomness comes from ``randbytes`` (os entropy by default): 53 bits per element."""
    x = np.asarray(update, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(x)):
        raise ValueError("secagg: the update holds NaN or Inf")
    c = config.clip
    scaled = (np.clip(x, -c, c) + c) * (levels(config) / (2.0 * c))
    raw = np.frombuffer(randbytes(8 * x.size), dtype="<u8")
    uniform = (raw >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    q = np.floor(scaled + uniform)
    np.clip(q, 0, levels(config), out=q)
    out: np.ndarray = q.astype(np.uint64)
    return out


def clamp_weight(weight: int, config: SecAggConfig) -> int:
    """A device's weight (its sample count) in [1, max_weight]."""
    return max(1, min(int(weight), config.max_weight))


def weighted(q: np.ndarray, weight: int, config: SecAggConfig) -> np.ndarray:
    """w*q with w appended: what a device masks (exact: the config's check bounds it)."""
    w = clamp_weight(weight, config)
    out = np.empty(q.size + 1, dtype=np.uint64)
    np.multiply(q, np.uint64(w), out=out[:-1])
    out[-1] = w
    return out


def dequantize_sum(values: np.ndarray, total_weight: int, config: SecAggConfig) -> np.ndarray:
    """mean = (sum w q / sum w) * 2c/(2**b - 1) - c, in float64, returned as float32."""
    if total_weight <= 0:
        raise ValueError("secagg: a weighted mean needs a positive total weight")
    step = 2.0 * config.clip / levels(config)
    mean = values.astype(np.float64) / float(total_weight) * step - config.clip
    return mean.astype(np.float32)


def dequantize(q: np.ndarray, config: SecAggConfig) -> np.ndarray:
    """One device's quantized update back on the float grid (float64), for comparisons."""
    return q.astype(np.float64) * (2.0 * config.clip / levels(config)) - config.clip
