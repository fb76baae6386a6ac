"""A task whose training always fails, as a user's buggy task might."""

from __future__ import annotations

from typing import Any

from flotilla.tasks.digits import DigitsTask


class BrokenDigits(DigitsTask):
    def train(self, *args: Any) -> Any:
        raise RuntimeError("this task cannot train")
