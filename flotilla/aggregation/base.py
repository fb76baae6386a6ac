"""The :class:`Aggregator` protocol and the pieces every strategy shares.

An aggregator lives as long as its job: ``begin`` opens a round on the current global
model, ``add`` takes each accepted update, ``finalize`` returns the next global model.
Whatever must survive a server restart (optimizer moments, clip norms, privacy history)
comes out of ``state()`` as a flat tensor dict the engine stores next to the checkpoint.

Strategies with more to offer declare it by capability, each a protocol of its own that
the engine checks with ``isinstance``: :class:`PrivacyBudgeted` (DP's sampling-rate
budget), :class:`StalenessWeighted` (updates trained on an older model) and
:class:`Buffering` (finalize whenever a buffer is full, not once per round).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np

from flotilla.aggregation._kernels import (
    axpy,
    check_state,
    check_update,
    check_weight,
    flat_view,
    zeros,
)
from flotilla.core.errors import SpecError, UpdateRejected
from flotilla.core.tensors import ModelState, TensorSpec


@dataclass(frozen=True, slots=True)
class Traits:
    """What the engine must do differently for a strategy."""

    #: Robust rules: the round's updates are spooled to disk and finalize reads them all.
    needs_all_updates: bool = False
    #: DP: the round's sampling rate matters (the engine calls a :class:`PrivacyBudgeted`
    #: aggregator's ``check_budget(q)`` before each round and ``spend(q)`` after finalize).
    needs_sampling_rate: bool = False
    #: FedBuff: the job runs buffered rounds (the engine's ``BufferedRounds`` mode), over a
    #: :class:`StalenessWeighted`, :class:`Buffering` aggregator.
    asynchronous: bool = False


@runtime_checkable
class Aggregator(Protocol):
    """Turns one round's accepted updates into the next global model."""

    traits: ClassVar[Traits]

    @property
    def count(self) -> int:
        """Updates accepted since ``begin``."""
        ...

    @property
    def total_weight(self) -> float:
        """Sum of the weights passed to ``add`` since ``begin``."""
        ...

    def begin(self, round: int, global_state: ModelState) -> None:
        """Open ``round`` on ``global_state``; drops anything left from an unfinished round."""
        ...

    def add(self, update: Mapping[str, np.ndarray], weight: float) -> None:
        """Validate the whole update (UpdateRejected leaves everything untouched), then use it."""
        ...

    def finalize(self) -> ModelState:
        """The next global model; UpdateRejected when there is nothing or it is not finite."""
        ...

    def state(self) -> ModelState:
        """Server state that must outlive the process: name -> array, scalars 0-d."""
        ...

    def restore(self, state: ModelState) -> None:
        """Load what ``state()`` returned; SpecError when it does not fit this aggregator."""
        ...

    def client_config(self) -> dict[str, float]:
        """Extra task config clients need (FedProx's ``proximal_mu``); usually empty."""
        ...

    def close(self) -> None:
        """Release disk spool and buffers; idempotent."""
        ...


@runtime_checkable
class PrivacyBudgeted(Protocol):
    """A strategy that spends a privacy budget per round, at the round's sampling rate."""

    def check_budget(self, q: float) -> float:
        """Refuse (BudgetExhausted) a round at sampling rate ``q`` the budget cannot pay
        for; else plan it and return the epsilon it would bring the job to."""
        ...

    def spend(self, q: float | None = None) -> float:
        """Record a finalized round (at ``q``, default the planned rate); returns epsilon."""
        ...


@runtime_checkable
class StalenessWeighted(Protocol):
    """A strategy that takes updates trained on an older model, weighted by staleness."""

    def add_stale(self, update: Mapping[str, np.ndarray], weight: float, staleness: int) -> None:
        """``add`` for an update trained ``staleness`` committed models ago."""
        ...


@runtime_checkable
class SecurelySummed(Protocol):
    """A strategy that needs to know how many updates a securely aggregated sum holds
    (DP-FedAvg: its noise and mean are per update), not only their total weight."""

    def add_sum(self, total: Mapping[str, np.ndarray], count: int) -> None:
        """Fold the sum of ``count`` updates, each already clipped on its device (secure
        aggregation shows the server the sum and nothing else)."""
        ...


@dataclass(frozen=True, slots=True)
class PartialSum:
    """Part of a round folded elsewhere (a simulation worker) with the strategy's own
    per-update rule, ``add``: the running sum, the weight and count it holds, and the
    per-update tallies the strategy keeps (DP-FedAvg's unclipped count)."""

    total: ModelState
    weight: float
    count: int
    tallies: Mapping[str, float] = field(default_factory=dict)


def merge_partials(partials: Sequence[PartialSum]) -> PartialSum:
    """One partial holding every update of ``partials`` (at least one)."""
    first, *rest = partials
    total = {name: np.array(arr, dtype=np.float32) for name, arr in first.total.items()}
    tallies = dict(first.tallies)
    for other in rest:
        for name, acc in total.items():
            acc += other.total[name]
        for key, value in other.tallies.items():
            tallies[key] = tallies.get(key, 0.0) + value
    return PartialSum(
        total,
        sum(p.weight for p in partials),
        sum(p.count for p in partials),
        tallies,
    )


@runtime_checkable
class FoldsPartials(Protocol):
    """A linear strategy, on the server: a round's aggregator takes a :class:`PartialSum`
    as if each of its updates had been ``add``-ed to it (equal up to the order of float
    summation). The partial comes from a copy of the strategy elsewhere
    (:class:`MakesPartials`), built with the spec's parameters and ``fold_overrides``."""

    def fold_overrides(self) -> dict[str, float]:
        """Parameters a copy must ``add`` with now, beyond the spec's (what the server
        learned since: DP-FedAvg's adaptive clip norm)."""
        ...

    def add_partial(self, partial: PartialSum) -> None:
        """Fold a partial sum; UpdateRejected (nothing changed) if it is not finite."""
        ...


@runtime_checkable
class MakesPartials(Protocol):
    """A linear strategy, where updates are trained: what it ``add``-ed, as one partial."""

    def partial(self) -> PartialSum:
        """What was added since ``begin``, handed out (the round stays open, empty)."""
        ...


@runtime_checkable
class Buffering(Protocol):
    """A strategy that finalizes whenever its buffer is full, not at a round's end."""

    def ready(self) -> bool:
        """True when enough updates are buffered to finalize."""
        ...


def require(ok: bool, param: str, rule: str, value: object) -> None:
    """Raise SpecError naming ``param`` unless ``ok``."""
    if not ok:
        raise SpecError(f"{param} must be {rule}, got {value!r}")


def positive(param: str, value: float) -> None:
    require(value > 0 and math.isfinite(value), param, "a finite number > 0", value)


def fraction(param: str, value: float, *, closed_low: bool = True) -> None:
    ok = (0.0 <= value < 1.0) if closed_low else (0.0 < value < 1.0)
    require(ok, param, "in [0, 1)" if closed_low else "in (0, 1)", value)


def validate(layout: tuple[TensorSpec, ...], update: Mapping[str, np.ndarray], w: float) -> None:
    """Everything an aggregator checks before it touches any of its own state."""
    check_weight(w)
    check_update(layout, update)


class RoundGuard:
    """begin/finalize bookkeeping: which round is open and on which global model."""

    def __init__(self, layout: tuple[TensorSpec, ...]) -> None:
        self.layout = layout
        self.round = 0
        self._global: ModelState | None = None

    def begin(self, round: int, global_state: Mapping[str, np.ndarray]) -> None:
        check_state(self.layout, global_state, "global_state")
        self.round = round
        self._global = dict(global_state)

    def open(self) -> ModelState:
        """The round's global model; RuntimeError when no round is open."""
        if self._global is None:
            raise RuntimeError("no round is open: call begin(round, global_state) first")
        return self._global

    def end(self) -> None:
        self._global = None


class WeightedSum:
    """Running ``sum(c_i * x_i)``: one float32 buffer per tensor, whatever the fleet size."""

    def __init__(self, layout: tuple[TensorSpec, ...]) -> None:
        self._layout = layout
        self._acc: ModelState | None = None
        self._flat: np.ndarray | None = None
        self.count = 0
        self.total_weight = 0.0

    def reset(self) -> None:
        self._acc = None
        self._flat = None
        self.count = 0
        self.total_weight = 0.0

    def fold(self, update: Mapping[str, np.ndarray], coef: float, weight: float) -> None:
        """Add ``coef * update``; the caller has validated it. ``weight`` adds to the total."""
        if self._acc is None:
            self._acc = zeros(self._layout)  # allocated on first use: a retried round is free
            self._flat = flat_view(self._acc, self._layout)
        whole = None if self._flat is None else flat_view(update, self._layout)
        if whole is not None and self._flat is not None:
            axpy(self._flat, whole, coef)
        else:
            for name, acc in self._acc.items():
                axpy(acc, update[name], coef)
        self.count += 1
        self.total_weight += weight

    def merge(self, total: Mapping[str, np.ndarray], weight: float, count: int) -> None:
        """Add a sum folded elsewhere, of ``count`` updates weighing ``weight``."""
        self.fold(total, 1.0, weight)
        self.count += count - 1

    def take(self, scale: float) -> ModelState:
        """Hand out ``scale * sum`` (the buffers themselves) and start empty again."""
        if self._acc is None or self.count == 0:
            raise UpdateRejected("no updates to aggregate")
        acc, self._acc, self._flat = self._acc, None, None
        with np.errstate(over="ignore", invalid="ignore"):
            for buf in acc.values():
                np.multiply(buf, np.float32(scale), out=buf)
        self.count = 0
        self.total_weight = 0.0
        return acc


def tensor_state(prefix: str, arrays: Mapping[str, np.ndarray]) -> ModelState:
    """``{prefix/name: array}``: per-tensor server state under a strategy's namespace."""
    return {f"{prefix}/{name}": arr for name, arr in arrays.items()}


def restore_tensors(
    prefix: str, layout: tuple[TensorSpec, ...], state: Mapping[str, np.ndarray]
) -> ModelState | None:
    """The per-tensor arrays saved under ``prefix``, float32 copies; None when absent."""
    keys = {f"{prefix}/{s.name}": s for s in layout}
    present = [k for k in keys if k in state]
    if not present:
        return None
    if len(present) != len(keys):
        missing = sorted(set(keys) - set(present))
        raise SpecError(f"aggregator state is missing {missing}")
    out: ModelState = {}
    for key, spec in keys.items():
        arr = np.asarray(state[key])
        if tuple(arr.shape) != spec.shape:
            raise SpecError(f"aggregator state {key!r} has shape {list(arr.shape)}")
        out[spec.name] = np.array(arr, dtype=np.float32)
    return out


def refuse_unknown(state: Mapping[str, np.ndarray], known: set[str], strategy: str) -> None:
    extra = sorted(set(state) - known)
    if extra:
        raise SpecError(f"state keys {extra} do not belong to strategy {strategy!r}")


class StreamingBase:
    """What every streaming strategy shares: a round guard and one running weighted sum.

    Subclasses add their ``finalize`` (and ``state``/``restore`` when they keep any).
    """

    traits: ClassVar[Traits] = Traits()

    def __init__(self, layout: tuple[TensorSpec, ...]) -> None:
        self._layout = layout
        self._round = RoundGuard(layout)
        self._sum = WeightedSum(layout)

    @property
    def count(self) -> int:
        return self._sum.count

    @property
    def total_weight(self) -> float:
        return self._sum.total_weight

    def begin(self, round: int, global_state: ModelState) -> None:
        self._round.begin(round, global_state)
        self._sum.reset()

    def add(self, update: Mapping[str, np.ndarray], weight: float) -> None:
        self._round.open()
        validate(self._layout, update, weight)
        self._sum.fold(update, weight, weight)

    def partial(self) -> PartialSum:
        self._round.open()
        count, weight, tallies = self._sum.count, self._sum.total_weight, self._tallies()
        return PartialSum(self._sum.take(1.0), weight, count, tallies)

    def add_partial(self, partial: PartialSum) -> None:
        self._round.open()
        if partial.count < 1:
            raise UpdateRejected(f"a partial sum holds at least one update, not {partial.count}")
        validate(self._layout, partial.total, partial.weight)
        self._sum.merge(partial.total, partial.weight, partial.count)
        self._add_tallies(partial.tallies)

    def fold_overrides(self) -> dict[str, float]:
        return {}

    def _tallies(self) -> dict[str, float]:
        """Per-update counts a partial carries beside its sum (none here)."""
        return {}

    def _add_tallies(self, tallies: Mapping[str, float]) -> None:
        """Take a partial's per-update counts (none here)."""

    def _mean(self) -> tuple[ModelState, ModelState]:
        """(global model, weighted mean delta); the round is closed either way."""
        current = self._round.open()
        total = self._sum.total_weight
        try:
            return current, self._sum.take(1.0 / total if total else 1.0)
        finally:
            self._round.end()

    def client_config(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self._sum.reset()
        self._round.end()
