"""Aggregation: turning accepted updates into the next global model.

Every strategy follows :class:`Aggregator`: ``begin(round, global_state)``,
``add(update, weight)`` per accepted update, ``finalize() -> new model``, and
``state()``/``restore()`` for what must outlive the process. Build one by name with
:func:`make_aggregator`; :func:`strategy_info` says what the engine must do for it.

- ``base``: the protocol, :class:`Traits`, shared bookkeeping, and the capability
  protocols :class:`PrivacyBudgeted`, :class:`StalenessWeighted`, :class:`Buffering` and
  :class:`SecurelySummed`.
- ``fedavg``: :class:`FedAvg` (also FedProx's server side).
- ``fedopt``: server optimizers :class:`FedAvgM` and :class:`FedOpt` (Adam, Yogi, Adagrad).
- ``robust``: median, trimmed mean, Krum, multi-Krum, centered clipping, all over an
  on-disk :class:`UpdateSpool`.
- ``dp``: :class:`DPFedAvg` (fixed or adaptive clipping) and its :class:`PrivacyAccountant`.
- ``fedbuff``: :class:`FedBuff`, buffered asynchronous aggregation with staleness weights.
- ``registry``: :data:`STRATEGY_NAMES`, :func:`make_aggregator`, :func:`strategy_info`.

See ``docs/aggregation.md`` for the equations, defaults and memory behaviour.
"""

from flotilla.aggregation.base import (
    Aggregator,
    Buffering,
    FoldsPartials,
    MakesPartials,
    PartialSum,
    PrivacyBudgeted,
    SecurelySummed,
    StalenessWeighted,
    Traits,
    merge_partials,
)
from flotilla.aggregation.dp import (
    DPFedAvg,
    DPParams,
    PrivacyAccountant,
    dp_epsilon,
)
from flotilla.aggregation.fedavg import FedAvg, FedAvgParams, FedProxParams
from flotilla.aggregation.fedbuff import FedBuff, FedBuffParams, staleness_weight
from flotilla.aggregation.fedopt import FedAvgM, FedAvgMParams, FedOpt, FedOptParams
from flotilla.aggregation.registry import (
    STRATEGY_NAMES,
    StrategyInfo,
    make_aggregator,
    parse_params,
    strategy_info,
)
from flotilla.aggregation.robust import (
    CenteredClipping,
    CenteredClippingParams,
    CoordinateMedian,
    Krum,
    KrumParams,
    MedianParams,
    MultiKrumParams,
    RobustAggregator,
    TrimmedMean,
    TrimmedMeanParams,
)
from flotilla.aggregation.spool import SpoolLimits, UpdateSpool

__all__ = [
    "STRATEGY_NAMES",
    "Aggregator",
    "Buffering",
    "CenteredClipping",
    "CenteredClippingParams",
    "CoordinateMedian",
    "DPFedAvg",
    "DPParams",
    "FedAvg",
    "FedAvgM",
    "FedAvgMParams",
    "FedAvgParams",
    "FedBuff",
    "FedBuffParams",
    "FedOpt",
    "FedOptParams",
    "FedProxParams",
    "FoldsPartials",
    "Krum",
    "KrumParams",
    "MakesPartials",
    "MedianParams",
    "MultiKrumParams",
    "PartialSum",
    "PrivacyAccountant",
    "PrivacyBudgeted",
    "RobustAggregator",
    "SecurelySummed",
    "SpoolLimits",
    "StalenessWeighted",
    "StrategyInfo",
    "Traits",
    "TrimmedMean",
    "TrimmedMeanParams",
    "UpdateSpool",
    "dp_epsilon",
    "make_aggregator",
    "merge_partials",
    "parse_params",
    "staleness_weight",
    "strategy_info",
]
