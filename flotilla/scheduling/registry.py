"""Selector names to selectors, with params checked the way job specs are."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from flotilla.core.errors import SpecError
from flotilla.core.spec import SchedulingSection
from flotilla.core.tables import build_dataclass
from flotilla.scheduling.bayesian import BayesianParams, BayesianSelector
from flotilla.scheduling.cost import CostModel
from flotilla.scheduling.data_greedy import DataGreedyParams, DataGreedySelector
from flotilla.scheduling.duration import DurationModel
from flotilla.scheduling.heuristics import (
    FedCSParams,
    FedCSSelector,
    GreedyParams,
    GreedySelector,
    OortParams,
    OortSelector,
)
from flotilla.scheduling.pool import DevicePool
from flotilla.scheduling.rl import RLParams
from flotilla.scheduling.selector import RandomParams, RandomSelector, Selector
from flotilla.scheduling.tuned import TunedParams, TunedSelector


@dataclass(frozen=True, slots=True)
class SelectionContext:
    """What a selector is built from: the shared fleet knowledge and the job's terms."""

    durations: DurationModel
    cost: CostModel
    deadline_s: float
    rng: random.Random
    rounds_total: int


@dataclass(frozen=True, slots=True)
class SelectorInfo:
    name: str
    params: type
    build: Callable[[SelectionContext, Any], Selector]
    summary: str


def _bayesian(context: SelectionContext, params: BayesianParams) -> Selector:
    return BayesianSelector(
        context.durations, context.cost, context.deadline_s, context.rng, params
    )


def _rl(context: SelectionContext, params: RLParams) -> Selector:
    from flotilla.scheduling.rl import RLSelector  # torch: imported only when used

    return RLSelector(
        context.durations,
        context.cost,
        context.deadline_s,
        context.rounds_total,
        context.rng,
        params,
    )


_SELECTORS: Mapping[str, SelectorInfo] = MappingProxyType(
    {
        info.name: info
        for info in (
            SelectorInfo(
                "random", RandomParams, lambda c, p: RandomSelector(c.rng), "uniform sampling"
            ),
            SelectorInfo(
                "fedcs",
                FedCSParams,
                lambda c, p: FedCSSelector(c.durations, c.deadline_s, p),
                "as many as finish before the deadline, fastest first",
            ),
            SelectorInfo(
                "greedy",
                GreedyParams,
                lambda c, p: GreedySelector(c.durations, c.cost, p),
                "adds the device that raises alpha*T + beta*F least",
            ),
            SelectorInfo(
                "greedy+",
                DataGreedyParams,
                lambda c, p: DataGreedySelector(c.durations, c.cost, p),
                "greedy's pace and fairness, preferring data (samples x loss) at an "
                "explicit data-for-time rate",
            ),
            SelectorInfo(
                "tuned",
                TunedParams,
                lambda c, p: TunedSelector(c.durations, c.cost, c.rng, p),
                "greedy+ with its knobs learned per round by a Thompson-sampling bandit "
                "pooled across jobs",
            ),
            SelectorInfo(
                "oort",
                OortParams,
                lambda c, p: OortSelector(c.durations, c.rng, p),
                "loss utility x straggler penalty, exploration, staleness bonus",
            ),
            SelectorInfo(
                "rl",
                RLParams,
                _rl,
                "policy network scoring devices, REINFORCE on round cost",
            ),
            SelectorInfo(
                "bayesian",
                BayesianParams,
                _bayesian,
                "GP surrogate of round cost over candidate sets, log expected improvement",
            ),
        )
    }
)

#: Every name :func:`make_selector` accepts.
SELECTOR_NAMES: tuple[str, ...] = tuple(_SELECTORS)


def selector_params(section: SchedulingSection) -> object:
    """The selector's params dataclass; SpecError naming a bad selector or field."""
    try:
        info = _SELECTORS[section.selector]
    except KeyError:
        raise SpecError(
            f"scheduling.selector {section.selector!r} is not one of {', '.join(SELECTOR_NAMES)}"
        ) from None
    return build_dataclass(
        info.params, section.params, f"{section.selector} selector", "scheduling.params."
    )


def make_selector(
    section: SchedulingSection,
    pool: DevicePool,
    rng: random.Random,
    deadline_s: float,
    rounds_total: int = 100,
    task: str = "",
) -> Selector:
    """The job's selector, reading the pool's shared history (and the samples devices
    report for ``task``, the job's task)."""
    params = selector_params(section)
    durations = DurationModel(pool.history, pool.profile, default_s=deadline_s / 4, task=task)
    cost = CostModel(section.alpha, section.beta)
    context = SelectionContext(durations, cost, deadline_s, rng, rounds_total)
    return _SELECTORS[section.selector].build(context, params)
