"""A test-only digits task that takes its time: ``train.params.sleep_s`` seconds per round.

Long enough rounds let a test change a device's conditions while it trains (an agent
process loads it by name: ``--task tests.support.slow_task:SlowDigits``).
"""

from __future__ import annotations

import dataclasses
import time

from torch import nn

from flotilla.core.spec import TrainSection
from flotilla.tasks.base import LocalData
from flotilla.tasks.digits import DigitsTask

SLOW_DIGITS = "tests.support.slow_task:SlowDigits"


class SlowDigits(DigitsTask):
    """:class:`DigitsTask` that sleeps ``train.params.sleep_s`` (default 0) before training."""

    def train(
        self, model: nn.Module, data: LocalData, config: TrainSection, seed: int
    ) -> tuple[int, dict[str, float]]:
        time.sleep(float(config.params.get("sleep_s", 0.0)))
        return super().train(model, data, dataclasses.replace(config, params={}), seed)
