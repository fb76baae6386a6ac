"""Blockwise array kernels: every pass over a model touches it in bounded slices.

Aggregators see models of hundreds of megabytes, so ``a * x + y`` written naively would
allocate a model-sized temporary per update. These helpers work in place or in blocks of
:data:`BLOCK` elements, so the only model-sized arrays are the ones an aggregator owns.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from flotilla.core.errors import SpecError, UpdateRejected
from flotilla.core.tensors import FlatState, ModelState, TensorSpec, all_finite

#: Elements per block: a temporary of 1 MiB (float32), small against any model we serve.
BLOCK = 1 << 18
#: BLAS takes a 32-bit element count; longer tensors are folded in pieces of this size.
_BLAS_MAX = 1 << 30
#: Below this many elements numpy's two passes win: a BLAS call costs microseconds to
#: milliseconds of thread wake-up (far more on a busy machine) before it moves any data.
_BLAS_MIN = 1 << 20

Axpy = Callable[..., np.ndarray]


def blocks(size: int, block: int = BLOCK) -> Iterator[slice]:
    """Consecutive slices covering ``range(size)``."""
    for start in range(0, size, block):
        yield slice(start, min(start + block, size))


def numel(spec: TensorSpec) -> int:
    return math.prod(spec.shape)


def flat(arr: np.ndarray) -> np.ndarray:
    """A 1-D view (a copy only for non-contiguous input, which decoded updates never are)."""
    return np.asarray(arr).reshape(-1)


@functools.cache
def _blas_saxpy() -> Axpy | None:
    """SciPy's ``saxpy`` when installed: one fused pass, about twice numpy's multiply+add.

    Cached because it is an import, not state; numpy's path below is exact and used when
    SciPy is absent (it ships with the ``server`` extra through ``dp-accounting``).
    """
    try:
        from scipy.linalg.blas import saxpy  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - scipy is in the server extra
        return None
    return saxpy  # type: ignore[no-any-return]


def axpy(acc: np.ndarray, x: np.ndarray, a: float) -> None:
    """``acc += a * x`` in place; ``acc`` is a contiguous float32 array we own."""
    fa = acc.reshape(-1)
    fx = flat(x)
    saxpy = _blas_saxpy()
    if (
        saxpy is not None
        and fa.size >= _BLAS_MIN
        and fx.dtype == np.float32
        and fx.flags.c_contiguous
    ):
        for sl in blocks(fa.size, _BLAS_MAX):
            saxpy(fx[sl], fa[sl], a=a)
        return
    tmp = np.empty(min(BLOCK, fa.size), dtype=np.float32)
    scale = np.float32(a)
    with np.errstate(over="ignore", invalid="ignore"):  # callers check the result
        for sl in blocks(fa.size):
            part = tmp[: sl.stop - sl.start]
            np.multiply(fx[sl], scale, out=part, casting="unsafe")
            np.add(fa[sl], part, out=fa[sl])


def squared_norm(arr: np.ndarray) -> float:
    """``sum(arr**2)`` accumulated in float64, so a clip bound holds to float32 rounding."""
    fx = flat(arr)
    tmp = np.empty(min(BLOCK, fx.size), dtype=np.float64)
    total = 0.0
    for sl in blocks(fx.size):
        part = tmp[: sl.stop - sl.start]
        np.copyto(part, fx[sl], casting="unsafe")
        # einsum, not BLAS: a threaded ddot per small block stalls on a busy machine.
        total += float(np.einsum("i,i->", part, part))
    return total


def check_weight(weight: float) -> None:
    if isinstance(weight, bool) or not weight > 0 or not math.isfinite(weight):
        raise UpdateRejected(f"update weight must be a positive number, got {weight!r}")


def check_update(
    layout: tuple[TensorSpec, ...], update: Mapping[str, np.ndarray], *, finite: bool = True
) -> None:
    """Names, shapes, then finiteness of a whole update, before any of it is used.

    ``finite=False`` leaves NaN/Inf to a caller that reads every value anyway (DP's norm).
    """
    if isinstance(update, FlatState) and update.layout == layout:
        # Names, shapes and dtype hold by construction: only the values need a look.
        if finite and not all_finite(update.flat):
            _name_non_finite(update, layout)
        return
    want = {s.name for s in layout}
    have = set(update)
    if have != want:
        missing, extra = sorted(want - have), sorted(have - want)
        raise UpdateRejected(f"tensor names differ: missing {missing}, unexpected {extra}")
    for spec in layout:
        arr = update[spec.name]
        if not isinstance(arr, (np.ndarray, np.generic)) or arr.dtype.kind not in "fiub":
            raise UpdateRejected(f"tensor {spec.name!r} is not a numeric numpy array")
        if tuple(arr.shape) != spec.shape:
            raise UpdateRejected(
                f"tensor {spec.name!r}: shape {list(arr.shape)}, expected {list(spec.shape)}"
            )
    if finite:
        _name_non_finite(update, layout)


def _name_non_finite(update: Mapping[str, np.ndarray], layout: tuple[TensorSpec, ...]) -> None:
    """UpdateRejected naming the first tensor with a NaN or Inf, if there is one."""
    for spec in layout:
        if not all_finite(update[spec.name]):
            raise UpdateRejected(f"tensor {spec.name!r} contains NaN or Inf")


def check_state(layout: tuple[TensorSpec, ...], state: Mapping[str, np.ndarray], what: str) -> None:
    """A model handed to ``begin`` must have the layout the aggregator was built for."""
    want = {s.name: s.shape for s in layout}
    if set(state) != set(want):
        raise SpecError(
            f"{what}: tensor names differ from the layout: missing "
            f"{sorted(set(want) - set(state))}, unexpected {sorted(set(state) - set(want))}"
        )
    for name, shape in want.items():
        if tuple(np.shape(state[name])) != shape:
            raise SpecError(f"{what}: tensor {name!r} has shape {list(np.shape(state[name]))}")


def zeros(layout: tuple[TensorSpec, ...]) -> FlatState:
    """float32 zeros, as views of one buffer; pages are only committed as they are written."""
    return FlatState(np.zeros(sum(numel(s) for s in layout), dtype=np.float32), layout)


def flat_view(state: Mapping[str, np.ndarray], layout: tuple[TensorSpec, ...]) -> np.ndarray | None:
    """The whole of ``state`` as one 1-D array when it is a :class:`FlatState` in
    ``layout``'s order; a model of many small tensors is then one pass, not one call per
    tensor. None otherwise."""
    if isinstance(state, FlatState) and state.layout == layout:
        return state.flat
    return None


def apply_step(global_state: Mapping[str, np.ndarray], step: ModelState, lr: float) -> ModelState:
    """``global + lr * step``, written into ``step``'s buffers and cast to the model dtypes.

    Refuses a non-finite result: finite updates can still overflow float32 when summed, and
    such a model must never be committed.
    """
    out: ModelState = {}
    with np.errstate(over="ignore", invalid="ignore"):
        for name, buf in step.items():
            if lr != 1.0:
                np.multiply(buf, np.float32(lr), out=buf)
            base = np.asarray(global_state[name])
            np.add(buf, base, out=buf, casting="unsafe")
            out[name] = buf.astype(base.dtype, copy=False)
    for name, arr in out.items():
        if not all_finite(arr):
            raise UpdateRejected(f"the aggregate is not finite: tensor {name!r} has NaN or Inf")
    return out


def scalar(value: float) -> np.ndarray:
    """A 0-d float64 array: how scalars travel in ``state()``."""
    return np.array(value, dtype=np.float64)
