"""Scheduling: which devices serve which job's round.

- ``pool``: :class:`DevicePool`, online devices, their occupancy (one job at a time) and
  the per-job history (``history``) every selector learns from.
- ``duration``: :class:`DurationModel`, a device's predicted round time for a job.
- ``arbiter``: :class:`Arbiter`, devices for the jobs that ask at the same moment, jointly.
- ``leases``: :class:`Leases`, the one owner of occupancy: claim-and-dispatch in one call,
  every release (backends report them as :class:`DeviceEvents`).
- ``cost``: :class:`CostModel`, ``alpha * T + beta * F``, and fairness measures.
- ``selector``: the :class:`Selector` protocol and :class:`RandomSelector`;
  ``heuristics``: FedCS, greedy and Oort; ``registry``: names to selectors.
"""

from flotilla.scheduling.arbiter import Arbiter, DeviceRequest, Grant
from flotilla.scheduling.cost import CostModel, jain_index, selection_variance
from flotilla.scheduling.duration import DurationModel, Prediction
from flotilla.scheduling.heuristics import (
    FedCSParams,
    FedCSSelector,
    GreedyParams,
    GreedySelector,
    OortParams,
    OortSelector,
)
from flotilla.scheduling.history import DeviceHistory, FleetHistory, KnobTrial, RoundOutcome
from flotilla.scheduling.leases import DeviceEvents, Lease, Leases
from flotilla.scheduling.pool import DevicePool, DeviceState, DeviceView
from flotilla.scheduling.registry import SELECTOR_NAMES, make_selector, selector_params
from flotilla.scheduling.selector import RandomParams, RandomSelector, Selector

__all__ = [
    "SELECTOR_NAMES",
    "Arbiter",
    "CostModel",
    "DeviceEvents",
    "DeviceHistory",
    "DevicePool",
    "DeviceRequest",
    "DeviceState",
    "DeviceView",
    "DurationModel",
    "FedCSParams",
    "FedCSSelector",
    "FleetHistory",
    "Grant",
    "GreedyParams",
    "GreedySelector",
    "KnobTrial",
    "Lease",
    "Leases",
    "OortParams",
    "OortSelector",
    "Prediction",
    "RandomParams",
    "RandomSelector",
    "RoundOutcome",
    "Selector",
    "jain_index",
    "make_selector",
    "selection_variance",
    "selector_params",
]
