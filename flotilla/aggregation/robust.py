"""Byzantine-robust rules: coordinate median, trimmed mean, (multi-)Krum, centered clipping.

They need every update of the round at once, so updates go to an on-disk
:class:`~flotilla.aggregation.spool.UpdateSpool`; finalize walks it in column blocks
(RAM ``O(block x n) + O(model)``). All rules are unweighted: a device's sample count is
its own claim, and letting it scale the vote would hand a liar the weight it asks for.
The result ``r`` is applied as ``x_{t+1} = x_t + server_lr * r``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import numpy as np

from flotilla.aggregation._kernels import numel
from flotilla.aggregation.base import (
    RoundGuard,
    Traits,
    positive,
    refuse_unknown,
    require,
    restore_tensors,
    tensor_state,
    validate,
)
from flotilla.aggregation.spool import SpoolLimits, UpdateSpool
from flotilla.core.errors import UpdateRejected
from flotilla.core.tensors import ModelState, TensorSpec, all_finite

#: Bytes of one column block across all spooled updates.
COLUMN_BLOCK_BYTES = 16 << 20
#: Narrowest column block, so a huge round still reads rows in useful runs.
MIN_COLUMNS = 1024


def column_blocks(n: int, size: int) -> Iterator[slice]:
    """Column slices such that ``n`` rows of one slice take about COLUMN_BLOCK_BYTES."""
    width = max(MIN_COLUMNS, COLUMN_BLOCK_BYTES // (4 * max(n, 1)))
    for start in range(0, size, width):
        yield slice(start, min(start + width, size))


def _sorted_columns(spool: UpdateSpool, sl: slice) -> np.ndarray:
    """``(width, n)``, each row one coordinate's values sorted (SIMD sort beats select)."""
    block = np.ascontiguousarray(spool.columns(sl.start, sl.stop).T)
    block.sort(axis=1)
    return block


@dataclass(frozen=True, slots=True)
class MedianParams:
    """``median``: coordinate-wise median (Yin et al. 2018)."""

    server_lr: float = 1.0

    def __post_init__(self) -> None:
        positive("server_lr", self.server_lr)


@dataclass(frozen=True, slots=True)
class TrimmedMeanParams:
    """``trimmed_mean``: drop ``floor(beta * n)`` values at each end of every coordinate."""

    beta: float = 0.1
    server_lr: float = 1.0

    def __post_init__(self) -> None:
        require(0.0 <= self.beta < 0.5, "beta", "in [0, 0.5)", self.beta)
        positive("server_lr", self.server_lr)


@dataclass(frozen=True, slots=True)
class KrumParams:
    """``krum`` (Blanchard et al. 2017): the update closest to its ``n - f - 2`` neighbours."""

    #: Byzantine updates tolerated; a round needs at least ``2f + 3`` updates.
    f: int = 1
    server_lr: float = 1.0

    def __post_init__(self) -> None:
        require(self.f >= 0, "f", "an integer >= 0", self.f)
        positive("server_lr", self.server_lr)


@dataclass(frozen=True, slots=True)
class MultiKrumParams:
    """``multikrum``: the mean of the ``m`` best Krum scores (default and cap ``n - f``)."""

    f: int = 1
    m: int | None = None
    server_lr: float = 1.0

    def __post_init__(self) -> None:
        require(self.f >= 0, "f", "an integer >= 0", self.f)
        require(self.m is None or self.m >= 1, "m", "an integer >= 1", self.m)
        positive("server_lr", self.server_lr)


@dataclass(frozen=True, slots=True)
class CenteredClippingParams:
    """``centered_clipping`` (Karimireddy et al. 2021), started at last round's result."""

    #: Clipping radius around the current centre (L2, whole update).
    tau: float = 1.0
    #: Clipping iterations ``L`` per round.
    iterations: int = 1
    server_lr: float = 1.0

    def __post_init__(self) -> None:
        positive("tau", self.tau)
        require(self.iterations >= 1, "iterations", "an integer >= 1", self.iterations)
        positive("server_lr", self.server_lr)


class RobustRule(Protocol):
    """The maths of one rule: spooled rows in, the flat aggregate out."""

    name: str

    def min_updates(self) -> int: ...

    def aggregate(self, spool: UpdateSpool, out: np.ndarray) -> None: ...


class CoordinateMedian:
    name = "median"

    def min_updates(self) -> int:
        return 1

    def aggregate(self, spool: UpdateSpool, out: np.ndarray) -> None:
        n, half = spool.count, spool.count // 2
        for sl in column_blocks(n, out.size):
            xs = _sorted_columns(spool, sl)
            if n % 2:
                out[sl] = xs[:, half]
            else:
                out[sl] = (xs[:, half - 1].astype(np.float64) + xs[:, half]) / 2


class TrimmedMean:
    name = "trimmed_mean"

    def __init__(self, beta: float) -> None:
        self.beta = beta

    def min_updates(self) -> int:
        return 1

    def aggregate(self, spool: UpdateSpool, out: np.ndarray) -> None:
        n = spool.count
        k = math.floor(self.beta * n)
        for sl in column_blocks(n, out.size):
            if k == 0:
                out[sl] = spool.columns(sl.start, sl.stop).mean(axis=0, dtype=np.float64)
            else:
                xs = _sorted_columns(spool, sl)
                out[sl] = xs[:, k : n - k].sum(axis=1, dtype=np.float64) / (n - 2 * k)


def krum_scores(sq_dist: np.ndarray, f: int) -> np.ndarray:
    """Each row's sum of squared distances to its ``n - f - 2`` nearest other rows."""
    n = sq_dist.shape[0]
    d = np.array(sq_dist, dtype=np.float64)
    np.fill_diagonal(d, np.inf)
    scores: np.ndarray = np.sort(d, axis=1)[:, : n - f - 2].sum(axis=1)
    return scores


class Krum:
    """Krum (``m=1``) and multi-Krum; ``selected`` holds the last round's chosen rows."""

    def __init__(self, f: int, m: int | None, multi: bool) -> None:
        self.f, self.m, self.multi = f, m, multi
        self.name = "multikrum" if multi else "krum"
        self.selected: tuple[int, ...] = ()

    def min_updates(self) -> int:
        return 2 * self.f + 3

    def aggregate(self, spool: UpdateSpool, out: np.ndarray) -> None:
        n = spool.count
        gram = np.zeros((n, n), dtype=np.float64)
        for sl in column_blocks(n, out.size):
            x = spool.columns(sl.start, sl.stop)
            x -= x.mean(axis=0)  # distances ignore a shift; centring avoids cancellation
            gram += x @ x.T
        diag = np.diag(gram)
        sq_dist = np.maximum(diag[:, None] + diag[None, :] - 2 * gram, 0.0)
        scores = krum_scores(sq_dist, self.f)
        m = min(self.m or n - self.f, n - self.f) if self.multi else 1
        chosen = np.sort(np.argsort(scores, kind="stable")[:m])
        self.selected = tuple(int(i) for i in chosen)
        for sl in column_blocks(m, out.size):  # reads only the chosen rows
            block = spool.columns(sl.start, sl.stop, self.selected)
            out[sl] = block.mean(axis=0, dtype=np.float64)


class CenteredClipping:
    """``v <- v + mean_i clip(x_i - v, tau)``, ``L`` times, ``v`` kept across rounds."""

    name = "centered_clipping"

    def __init__(self, tau: float, iterations: int) -> None:
        self.tau, self.iterations = tau, iterations
        self.centre: np.ndarray | None = None  # flat float32, the previous round's result

    def min_updates(self) -> int:
        return 1

    def aggregate(self, spool: UpdateSpool, out: np.ndarray) -> None:
        n = spool.count
        out[...] = self.centre if self.centre is not None else 0.0
        cols = list(column_blocks(n, out.size))
        norms = np.zeros(n, dtype=np.float64)
        for sl in cols:
            diff = spool.columns(sl.start, sl.stop) - out[sl]
            norms += np.einsum("ij,ij->i", diff, diff, dtype=np.float64)
        for it in range(self.iterations):
            dist = np.sqrt(norms)
            scale = np.where(dist > self.tau, self.tau / np.maximum(dist, 1e-300), 1.0) / n
            last = it == self.iterations - 1
            norms = np.zeros(n, dtype=np.float64)
            for sl in cols:
                diff = spool.columns(sl.start, sl.stop) - out[sl]
                step = scale @ diff
                out[sl] += step
                if not last:  # the next iteration's distances, from the same block read
                    diff -= step.astype(np.float32)
                    norms += np.einsum("ij,ij->i", diff, diff, dtype=np.float64)

    def commit(self, result: np.ndarray) -> None:
        self.centre = result


class RobustAggregator:
    """Spools the round, then applies a :class:`RobustRule` in column blocks."""

    traits: ClassVar[Traits] = Traits(needs_all_updates=True)

    def __init__(
        self,
        layout: tuple[TensorSpec, ...],
        rule: RobustRule,
        spool_dir: Path,
        server_lr: float = 1.0,
        limits: SpoolLimits | None = None,
    ) -> None:
        self.rule = rule
        self.server_lr = server_lr
        self._layout = layout
        self._round = RoundGuard(layout)
        self._spool = UpdateSpool(spool_dir, layout, limits)
        self._weight = 0.0

    @property
    def count(self) -> int:
        return self._spool.count

    @property
    def total_weight(self) -> float:
        return self._weight

    @property
    def min_updates(self) -> int:
        """Fewest updates finalize accepts (Krum: ``2f + 3``)."""
        return self.rule.min_updates()

    @property
    def spool_path(self) -> Path | None:
        return self._spool.path

    def begin(self, round: int, global_state: ModelState) -> None:
        self._round.begin(round, global_state)
        self._spool.open(round)
        self._weight = 0.0

    def add(self, update: Mapping[str, np.ndarray], weight: float) -> None:
        self._round.open()
        validate(self._layout, update, weight)
        self._spool.append(update)
        self._weight += weight

    def finalize(self) -> ModelState:
        current = self._round.open()
        n = self._spool.count
        if n < max(1, self.min_updates):
            raise UpdateRejected(
                f"{self.rule.name} needs at least {max(1, self.min_updates)} updates, got {n}"
            )
        result = np.empty(self._spool.row_elems, dtype=np.float32)
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                self.rule.aggregate(self._spool, result)
        finally:
            self._spool.close()
            self._round.end()
            self._weight = 0.0
        if not all_finite(result):
            raise UpdateRejected("the aggregate is not finite")
        new = self._apply(current, result)
        if isinstance(self.rule, CenteredClipping):
            self.rule.commit(result)
        return new

    def _apply(self, current: ModelState, result: np.ndarray) -> ModelState:
        out: ModelState = {}
        with np.errstate(over="ignore", invalid="ignore"):
            for spec, view in zip(self._layout, _split(self._layout, result), strict=True):
                base = np.asarray(current[spec.name])
                buf = np.array(view, dtype=np.float32)  # np.multiply would make 0-d a scalar
                buf *= np.float32(self.server_lr)
                np.add(buf, base, out=buf, casting="unsafe")
                out[spec.name] = buf.astype(base.dtype, copy=False)
                if not all_finite(out[spec.name]):
                    raise UpdateRejected(f"the new model is not finite in {spec.name!r}")
        return out

    def state(self) -> ModelState:
        rule = self.rule
        if isinstance(rule, CenteredClipping) and rule.centre is not None:
            views = zip(self._layout, _split(self._layout, rule.centre), strict=True)
            return tensor_state(f"{rule.name}/v", {s.name: v for s, v in views})
        return {}

    def restore(self, state: ModelState) -> None:
        rule = self.rule
        if not isinstance(rule, CenteredClipping):
            refuse_unknown(state, set(), rule.name)
            return
        refuse_unknown(state, {f"{rule.name}/v/{s.name}" for s in self._layout}, rule.name)
        tensors = restore_tensors(f"{rule.name}/v", self._layout, state)
        if tensors is None:
            rule.centre = None
            return
        rule.centre = np.concatenate([tensors[s.name].reshape(-1) for s in self._layout])

    def client_config(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self._spool.close()
        self._round.end()


def _split(layout: tuple[TensorSpec, ...], flat: np.ndarray) -> list[np.ndarray]:
    """Per-tensor views of a flat row, in layout order."""
    out, offset = [], 0
    for spec in layout:
        size = numel(spec)
        out.append(flat[offset : offset + size].reshape(spec.shape))
        offset += size
    return out
