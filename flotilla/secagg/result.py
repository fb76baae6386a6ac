"""What a SecAgg+ round yields: the weighted sum of the survivors' quantized updates."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flotilla.secagg.config import SecAggConfig
from flotilla.secagg.quantize import dequantize_sum


@dataclass(frozen=True, slots=True)
class MaskedSum:
    """``values``: sum_i w_i*q_i mod 2**m (uint64); ``total_weight``: sum_i w_i."""

    values: np.ndarray
    total_weight: int
    survivors: tuple[str, ...]

    def mean(self, config: SecAggConfig) -> np.ndarray:
        """The dequantized weighted mean (float32): plain FedAvg of the quantized updates."""
        return dequantize_sum(self.values, self.total_weight, config)
