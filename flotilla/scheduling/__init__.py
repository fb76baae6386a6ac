"""Scheduling: which devices serve which job's round.

- ``pool``: :class:`DevicePool`, online devices and their occupancy (one job at a time).
- ``selector``: the :class:`Selector` protocol and :class:`RandomSelector`.
"""

from flotilla.scheduling.pool import DevicePool, DeviceState
from flotilla.scheduling.selector import RandomSelector, RoundOutcome, Selector

__all__ = ["DevicePool", "DeviceState", "RandomSelector", "RoundOutcome", "Selector"]
