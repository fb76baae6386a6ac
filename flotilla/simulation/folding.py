"""Fold where you train: a worker turns its slice of a round into one partial sum.

Shipping every client's delta to the parent, which decodes and folds them one by one, is
what made more workers slower than one process. Here a worker runs the whole client path
for its slice, exactly as the server would see it: train, the device's upload
(:class:`~flotilla.simulation.uplink.SimulatedUplink`: the codec's encode and decode),
then the job's own strategy ``add``-s each update (its checks, DP's clipping) to a
partial sum (:class:`~flotilla.aggregation.PartialSum`). Only the partial and a few
numbers per client go back. Jobs whose strategy is not linear (robust rules need every
update) or whose devices keep state across rounds (error feedback, update momentum: one
file per job, written by one process) are trained the usual way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from flotilla.aggregation import (
    MakesPartials,
    PartialSum,
    make_aggregator,
    merge_partials,
    strategy_info,
)
from flotilla.core.errors import FlotillaError, UpdateRejected
from flotilla.core.round_config import RoundConfig
from flotilla.core.tensors import ModelState, TensorSpec
from flotilla.simulation.training import ClientTrainer
from flotilla.simulation.uplink import SimulatedUplink


@dataclass(frozen=True, slots=True)
class FoldRequest:
    """What folding a round's slice needs besides training: the job's upload and strategy."""

    job_id: str
    round: int
    #: The job's :class:`RoundConfig` as devices receive it (its uplink codec).
    config_json: str
    layout: tuple[TensorSpec, ...]
    #: Seeds the codec's randomness (:meth:`SimulatedUplink.context`).
    uplink_seed: int
    strategy: str
    #: The strategy's parameters, as JSON.
    params_json: str


@dataclass(frozen=True, slots=True)
class FoldedClient:
    """One client of a folded slice: what the round's record needs, and why its update
    was refused (empty when it is in the partial)."""

    index: int
    num_samples: int
    metrics: Mapping[str, float]
    bytes_up: int
    refused: str = ""


@dataclass(frozen=True, slots=True)
class FoldedSlice:
    """A slice of a round, folded: the clients in the order given, and the sum of those
    not refused (None when every one was)."""

    clients: tuple[FoldedClient, ...]
    partial: PartialSum | None


@runtime_checkable
class FoldingTrainer(Protocol):
    """A trainer that folds where it trains (the worker pools)."""

    def train_folded(
        self, global_state: ModelState, clients: Sequence[int], seed: int, request: FoldRequest
    ) -> FoldedSlice:
        """:meth:`SliceFolder.fold` over all of ``clients``, wherever they train."""
        ...


#: Deltas a worker holds at once: a slice trains in chunks this size, each folded before
#: the next trains (the simulator's own bound on a round's deltas in flight).
DELTAS_IN_FLIGHT_BYTES = 128 * 1024**2


class SliceFolder:
    """Folds slices of rounds with one trainer; each job's upload is made once and kept."""

    def __init__(
        self, trainer: ClientTrainer, deltas_in_flight_bytes: int = DELTAS_IN_FLIGHT_BYTES
    ) -> None:
        self._trainer = trainer
        self._chunk_bytes = deltas_in_flight_bytes
        self._uplinks: dict[str, SimulatedUplink] = {}

    def fold(
        self,
        global_state: ModelState,
        clients: Sequence[int],
        seed: int,
        request: FoldRequest,
    ) -> FoldedSlice:
        """Train ``clients`` from ``global_state`` and fold their uploads (module doc)."""
        config = RoundConfig.from_json(request.config_json)
        uplink = self._uplink(request, config)
        if strategy_info(request.strategy).traits.needs_all_updates:
            raise FlotillaError(f"strategy {request.strategy!r} cannot be folded in a worker")
        aggregator = make_aggregator(
            request.strategy, json.loads(request.params_json), request.layout, None
        )
        if not isinstance(aggregator, MakesPartials):
            raise FlotillaError(f"strategy {request.strategy!r} cannot be folded in a worker")
        aggregator.begin(request.round, global_state)
        delta_bytes = max(1, sum(s.nbytes for s in request.layout))
        chunk = max(1, self._chunk_bytes // delta_bytes)
        out = []
        for start in range(0, len(clients), chunk):
            part = clients[start : start + chunk]
            results = self._trainer.train(global_state, part, config.train, config.data, seed)
            for client, result in zip(part, results, strict=True):
                delta, sent = uplink(client, result.delta, request.round)
                refused = ""
                try:
                    aggregator.add(delta, float(result.num_samples))
                except UpdateRejected as exc:
                    refused = str(exc)
                metrics = dict(result.metrics)
                out.append(FoldedClient(client, result.num_samples, metrics, sent, refused))
            del results
        folded = any(not c.refused for c in out)
        return FoldedSlice(tuple(out), aggregator.partial() if folded else None)

    def _uplink(self, request: FoldRequest, config: RoundConfig) -> SimulatedUplink:
        uplink = self._uplinks.get(request.job_id)
        if uplink is None:
            uplink = SimulatedUplink(config, request.layout, request.uplink_seed, None, 0)
            self._uplinks[request.job_id] = uplink
        return uplink


def merge_slices(slices: Sequence[FoldedSlice]) -> FoldedSlice:
    """Consecutive slices of a round as one: their clients in order, their sums merged."""
    partials = [s.partial for s in slices if s.partial is not None]
    return FoldedSlice(
        tuple(c for s in slices for c in s.clients),
        merge_partials(partials) if partials else None,
    )
