"""FedAvg: the weighted mean a batch FedAvg would give, folded in O(model) memory."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest

from flotilla.aggregation import FedAvg, FedAvgParams
from flotilla.core.errors import UpdateRejected
from flotilla.core.tensors import ModelState, state_spec


def _model(rng: np.random.Generator) -> ModelState:
    return {
        "w": rng.standard_normal((8, 5)).astype(np.float32),
        "b": rng.standard_normal(5).astype(np.float32),
        "scale": np.array(1.5, dtype=np.float32),
    }


def _delta(model: ModelState, rng: np.random.Generator) -> ModelState:
    return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in model.items()}


def _batch_fedavg(
    model: ModelState, updates: list[tuple[ModelState, float]], server_lr: float = 1.0
) -> ModelState:
    total = sum(w for _, w in updates)
    return {
        k: model[k].astype(np.float64)
        + server_lr * sum(w * d[k].astype(np.float64) for d, w in updates) / total
        for k in model
    }


def _assert_states_close(got: ModelState, want: ModelState) -> None:
    assert list(got) == list(want)
    for name in want:
        assert got[name].shape == want[name].shape
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)


def _fedavg(model: ModelState, server_lr: float = 1.0) -> FedAvg:
    """An aggregator with round 1 open on ``model``."""
    agg = FedAvg(state_spec(model), FedAvgParams(server_lr=server_lr))
    agg.begin(1, model)
    return agg


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equals_the_batch_weighted_mean(seed: int) -> None:
    rng = np.random.default_rng(seed)
    model = _model(rng)
    updates = [(_delta(model, rng), float(rng.integers(1, 500))) for _ in range(17)]
    agg = _fedavg(model)
    for delta, weight in updates:
        agg.add(delta, weight)
    assert agg.count == 17
    assert agg.total_weight == sum(w for _, w in updates)
    out = agg.finalize()
    _assert_states_close(out, _batch_fedavg(model, updates))
    assert all(out[k].dtype == model[k].dtype for k in model)


def test_server_lr_scales_the_step() -> None:
    rng = np.random.default_rng(3)
    model = _model(rng)
    updates = [(_delta(model, rng), w) for w in (1.0, 3.0, 10.0)]
    agg = _fedavg(model, server_lr=0.25)
    for delta, weight in updates:
        agg.add(delta, weight)
    _assert_states_close(agg.finalize(), _batch_fedavg(model, updates, server_lr=0.25))


def _with(delta: ModelState, name: str, value: np.ndarray) -> ModelState:
    return {**delta, name: value}


def _poison(value: float) -> Callable[[ModelState], ModelState]:
    def make(delta: ModelState) -> ModelState:
        # Spoil the *last* tensor, so a fold-as-you-check aggregator would have touched the rest.
        arr = delta["scale"].copy()
        arr[...] = value
        return _with(delta, "scale", arr)

    return make


BAD_UPDATES: dict[str, tuple[Callable[[ModelState], ModelState], float]] = {
    "nan": (_poison(np.nan), 5.0),
    "inf": (_poison(np.inf), 5.0),
    "-inf": (_poison(-np.inf), 5.0),
    "nan in first tensor": (lambda d: _with(d, "w", np.full((8, 5), np.nan, np.float32)), 5.0),
    "wrong shape": (lambda d: _with(d, "scale", np.zeros(2, np.float32)), 5.0),
    "transposed": (lambda d: _with(d, "w", np.zeros((5, 8), np.float32)), 5.0),
    "missing tensor": (lambda d: {k: v for k, v in d.items() if k != "scale"}, 5.0),
    "zero weight": (lambda d: d, 0.0),
    "negative weight": (lambda d: d, -3.0),
    "nan weight": (lambda d: d, float("nan")),
    "inf weight": (lambda d: d, float("inf")),
}


@pytest.mark.parametrize("case", list(BAD_UPDATES))
def test_a_rejected_update_leaves_the_sum_untouched(case: str) -> None:
    spoil, weight = BAD_UPDATES[case]
    rng = np.random.default_rng(4)
    model = _model(rng)
    first, second, bad = _delta(model, rng), _delta(model, rng), _delta(model, rng)

    clean = _fedavg(model)
    clean.add(first, 2.0)
    clean.add(second, 7.0)

    agg = _fedavg(model)
    agg.add(first, 2.0)
    with pytest.raises(UpdateRejected):
        agg.add(spoil(bad), weight)
    assert (agg.count, agg.total_weight) == (1, 2.0)
    agg.add(second, 7.0)

    got, want = agg.finalize(), clean.finalize()
    for name in model:
        np.testing.assert_array_equal(got[name], want[name])


def test_finalize_without_updates_raises() -> None:
    model = _model(np.random.default_rng(5))
    with pytest.raises(UpdateRejected, match="no updates"):
        _fedavg(model).finalize()


def test_a_finalized_round_takes_nothing_more() -> None:
    rng = np.random.default_rng(6)
    model = _model(rng)
    agg = _fedavg(model)
    agg.add(_delta(model, rng), 1.0)
    agg.finalize()
    with pytest.raises(RuntimeError, match="no round is open"):
        agg.add(_delta(model, rng), 1.0)
    with pytest.raises(RuntimeError, match="no round is open"):
        agg.finalize()


def test_memory_stays_one_accumulator_per_tensor() -> None:
    n = 1_000_000
    rng = np.random.default_rng(7)
    model = {"w": np.zeros(n, dtype=np.float32)}
    model_bytes = model["w"].nbytes
    deltas = [{"w": rng.standard_normal(n).astype(np.float32)} for _ in range(3)]
    tracemalloc.start()
    try:
        agg = _fedavg(model)
        for i in range(50):
            agg.add(deltas[i % 3], float(i + 1))
        out = agg.finalize()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * model_bytes, f"peak {peak / model_bytes:.2f}x the model"
    want = sum((i + 1) * deltas[i % 3]["w"].astype(np.float64) for i in range(50)) / 1275
    np.testing.assert_allclose(out["w"], want, rtol=1e-4, atol=1e-5)


def test_an_aggregate_that_overflows_float32_is_refused() -> None:
    """Finite but huge updates can sum to Inf; that model must never be committed."""
    agg = _fedavg({"w": np.zeros(3, dtype=np.float32)})
    agg.add({"w": np.full(3, 3e38, dtype=np.float32)}, 10.0)
    agg.add({"w": np.full(3, 3e38, dtype=np.float32)}, 10.0)
    with pytest.raises(UpdateRejected, match="not finite"):
        agg.finalize()


def test_flat_states_are_one_buffer_and_keep_their_keys() -> None:
    from flotilla.aggregation._kernels import flat_view, zeros
    from flotilla.core.tensors import FlatState, TensorSpec

    layout = (TensorSpec("a", "F32", (3, 4)), TensorSpec("b", "F32", (5,)))
    assert flat_view(zeros(layout), layout) is not None
    row = np.arange(17, dtype=np.float32)
    state = FlatState(row, layout)
    np.testing.assert_array_equal(state["b"], row[12:])
    state["a"][0, 0] = 99.0  # the tensors are views: writes land in the buffer
    assert row[0] == 99.0
    view = flat_view(state, layout)
    assert view is row
    assert flat_view(dict(state), layout) is None, "a plain dict is folded tensor by tensor"
    assert flat_view(state, tuple(reversed(layout))) is None, "not in layout order"
    with pytest.raises(TypeError):
        state["a"] = np.zeros((3, 4), np.float32)
    with pytest.raises(TypeError):
        state.update({"a": np.zeros((3, 4), np.float32)})
    with pytest.raises(ValueError, match="18"):
        FlatState(np.zeros(18, np.float32), layout)
    import pickle  # between our own worker processes, never from the network

    copy = pickle.loads(pickle.dumps(state))
    assert isinstance(copy, FlatState) and copy.layout == layout
    np.testing.assert_array_equal(copy.flat, row)


def test_folding_one_buffer_updates_equals_folding_tensor_by_tensor() -> None:
    from flotilla.aggregation import make_aggregator, parse_params
    from flotilla.core.tensors import FlatState, TensorSpec

    layout = (TensorSpec("a", "F32", (30, 40)), TensorSpec("b", "F32", (50,)))
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((4, 1250)).astype(np.float32)
    joined = [FlatState(r, layout) for r in rows]
    apart = [{k: v.copy() for k, v in u.items()} for u in joined]
    results = []
    for updates in (joined, apart):
        agg = make_aggregator("fedavg", parse_params("fedavg", {}), layout, None)
        agg.begin(1, {"a": np.zeros((30, 40), np.float32), "b": np.zeros(50, np.float32)})
        for i, u in enumerate(updates):
            agg.add(u, float(i + 1))
        results.append(agg.finalize())
    for name in ("a", "b"):
        np.testing.assert_array_equal(results[0][name], results[1][name])
    joined[2]["b"][3] = np.nan
    agg = make_aggregator("fedavg", parse_params("fedavg", {}), layout, None)
    agg.begin(1, {"a": np.zeros((30, 40), np.float32), "b": np.zeros(50, np.float32)})
    with pytest.raises(UpdateRejected, match="'b'"):
        agg.add(joined[2], 1.0)
