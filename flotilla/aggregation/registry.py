"""Strategy names to aggregators, with params checked the way job specs are."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from flotilla.aggregation.base import Aggregator, Traits
from flotilla.aggregation.dp import DPFedAvg, DPParams
from flotilla.aggregation.fedavg import FedAvg, FedAvgParams, FedProxParams
from flotilla.aggregation.fedbuff import FedBuff, FedBuffParams
from flotilla.aggregation.fedopt import FedAvgM, FedAvgMParams, FedOpt, FedOptParams
from flotilla.aggregation.robust import (
    CenteredClipping,
    CenteredClippingParams,
    CoordinateMedian,
    Krum,
    KrumParams,
    MedianParams,
    MultiKrumParams,
    RobustAggregator,
    RobustRule,
    TrimmedMean,
    TrimmedMeanParams,
)
from flotilla.aggregation.spool import SpoolLimits
from flotilla.core.errors import SpecError
from flotilla.core.tables import build_dataclass
from flotilla.core.tensors import TensorSpec


@dataclass(frozen=True, slots=True)
class StrategyInfo:
    """What the engine needs to know about a strategy before building it."""

    name: str
    params: type
    traits: Traits
    summary: str


_STREAM = Traits()
_ROBUST = Traits(needs_all_updates=True)
_STRATEGIES: Mapping[str, StrategyInfo] = MappingProxyType(
    {
        info.name: info
        for info in (
            StrategyInfo("fedavg", FedAvgParams, _STREAM, "sample-weighted mean"),
            StrategyInfo("fedprox", FedProxParams, _STREAM, "FedAvg; clients add mu/2 ||w-w0||^2"),
            StrategyInfo("fedavgm", FedAvgMParams, _STREAM, "FedAvg with server momentum"),
            StrategyInfo("fedadam", FedOptParams, _STREAM, "Adam on the mean update"),
            StrategyInfo("fedyogi", FedOptParams, _STREAM, "Yogi on the mean update"),
            StrategyInfo("fedadagrad", FedOptParams, _STREAM, "Adagrad on the mean update"),
            StrategyInfo("median", MedianParams, _ROBUST, "coordinate-wise median"),
            StrategyInfo("trimmed_mean", TrimmedMeanParams, _ROBUST, "coordinate trimmed mean"),
            StrategyInfo("krum", KrumParams, _ROBUST, "the most central update"),
            StrategyInfo("multikrum", MultiKrumParams, _ROBUST, "mean of the m most central"),
            StrategyInfo(
                "centered_clipping", CenteredClippingParams, _ROBUST, "iterative clipping"
            ),
            StrategyInfo("dp_fedavg", DPParams, DPFedAvg.traits, "clipped, noised FedAvg"),
            StrategyInfo("fedbuff", FedBuffParams, FedBuff.traits, "asynchronous, buffered"),
        )
    }
)

#: Every name :func:`make_aggregator` accepts.
STRATEGY_NAMES: tuple[str, ...] = tuple(_STRATEGIES)


def strategy_info(name: str) -> StrategyInfo:
    """The strategy's params class and traits; SpecError listing the valid names."""
    try:
        return _STRATEGIES[name]
    except KeyError:
        raise SpecError(
            f"aggregation.strategy: unknown strategy {name!r} (valid: {', '.join(STRATEGY_NAMES)})"
        ) from None


def parse_params(name: str, params: Mapping[str, Any] | object) -> Any:
    """The strategy's params dataclass from a mapping; SpecError names a bad param."""
    info = strategy_info(name)
    if isinstance(params, info.params):
        return params
    if not isinstance(params, Mapping):
        raise SpecError(f"aggregation.params for {name!r} must be a table")
    return build_dataclass(info.params, params, f"aggregation.params ({name})")


def make_aggregator(
    name: str,
    params: Mapping[str, Any],
    layout: tuple[TensorSpec, ...],
    spool_dir: Path | None,
    *,
    spool_limits: SpoolLimits | None = None,
    rng: np.random.Generator | None = None,
) -> Aggregator:
    """Build the named strategy for a model ``layout``.

    ``spool_dir`` is required by robust rules (``strategy_info(name).traits
    .needs_all_updates``); ``rng`` only seeds DP noise in tests.
    """
    p = parse_params(name, params)
    if name in ("fedavg", "fedprox"):
        return FedAvg(layout, p)
    if name == "fedavgm":
        return FedAvgM(layout, p)
    if name in ("fedadam", "fedyogi", "fedadagrad"):
        return FedOpt(layout, name[3:], p)  # type: ignore[arg-type]
    if name == "dp_fedavg":
        return DPFedAvg(layout, p, rng)
    if name == "fedbuff":
        return FedBuff(layout, p)
    if spool_dir is None:
        raise SpecError(f"strategy {name!r} spools each round to disk: give it a spool_dir")
    return RobustAggregator(layout, _rule(name, p), Path(spool_dir), p.server_lr, spool_limits)


def _rule(name: str, p: Any) -> RobustRule:
    if name == "median":
        return CoordinateMedian()
    if name == "trimmed_mean":
        return TrimmedMean(p.beta)
    if name == "krum":
        return Krum(p.f, 1, multi=False)
    if name == "multikrum":
        return Krum(p.f, p.m, multi=True)
    return CenteredClipping(p.tau, p.iterations)
