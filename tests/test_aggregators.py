"""Aggregation strategies against references written straight from their papers' equations."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flotilla.aggregation import (
    STRATEGY_NAMES,
    Aggregator,
    DPFedAvg,
    FedBuff,
    FedBuffParams,
    FoldsPartials,
    MakesPartials,
    PartialSum,
    RobustAggregator,
    SpoolLimits,
    make_aggregator,
    merge_partials,
    strategy_info,
)
from flotilla.aggregation import robust as robust_mod
from flotilla.core.errors import BudgetExhausted, SpecError, UpdateRejected
from flotilla.core.tensors import ModelState, decode_state, encode_state, state_spec
from tests.support.lifetime import bound

ROBUST = ("median", "trimmed_mean", "krum", "multikrum", "centered_clipping")
FEDOPT = ("fedadam", "fedyogi", "fedadagrad")
BIG_BUDGET = {"epsilon": 1e300}  # DP tests that are not about the budget


def _model(rng: np.random.Generator) -> ModelState:
    return {
        "w": rng.standard_normal((12, 9)).astype(np.float32),
        "b": rng.standard_normal(9).astype(np.float32),
        "scale": np.array(1.5, dtype=np.float32),
    }


def _deltas(
    model: ModelState, rng: np.random.Generator, n: int, sd: float = 1.0
) -> list[ModelState]:
    return [
        {k: (sd * rng.standard_normal(v.shape)).astype(np.float32) for k, v in model.items()}
        for _ in range(n)
    ]


def _flat(state: ModelState, model: ModelState) -> np.ndarray:
    return np.concatenate([np.asarray(state[k], dtype=np.float64).reshape(-1) for k in model])


def _unflat(vec: np.ndarray, model: ModelState) -> dict[str, np.ndarray]:
    out, pos = {}, 0
    for k, v in model.items():
        out[k] = vec[pos : pos + v.size].reshape(v.shape)
        pos += v.size
    return out


def _rel_err(got: ModelState, want: dict[str, np.ndarray], model: ModelState) -> float:
    g, w = _flat(got, model), _flat(want, model)
    return float(np.linalg.norm(g - w) / np.linalg.norm(w))


def _make(name: str, model: ModelState, tmp_path: Path, **params: Any) -> Aggregator:
    if name == "dp_fedavg":
        params = {**BIG_BUDGET, **params}
    return make_aggregator(
        name, params, state_spec(model), tmp_path / "spool", rng=np.random.default_rng(99)
    )


def _round(
    agg: Aggregator,
    model: ModelState,
    updates: list[ModelState],
    weights: list[float],
    round_no: int = 1,
    q: float = 0.01,
) -> ModelState:
    if isinstance(agg, DPFedAvg):
        agg.check_budget(q)
    agg.begin(round_no, model)
    for delta, weight in zip(updates, weights, strict=True):
        agg.add(delta, weight)
    return agg.finalize()


@pytest.fixture
def narrow_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny column blocks, so the tests cross block boundaries inside tensors."""
    monkeypatch.setattr(robust_mod, "MIN_COLUMNS", 7)
    monkeypatch.setattr(robust_mod, "COLUMN_BLOCK_BYTES", 1)


# --- registry -------------------------------------------------------------------------


def test_registry_names_params_and_traits(tmp_path: Path) -> None:
    assert set(STRATEGY_NAMES) == {
        "fedavg",
        "fedprox",
        "fedavgm",
        *FEDOPT,
        *ROBUST,
        "dp_fedavg",
        "fedbuff",
    }
    layout = state_spec(_model(np.random.default_rng(0)))
    with pytest.raises(SpecError, match=r"unknown strategy 'fedsgd'.*fedavg, fedprox"):
        make_aggregator("fedsgd", {}, layout, None)
    with pytest.raises(SpecError, match="unknown field 'beta3'"):
        make_aggregator("fedadam", {"beta3": 0.9}, layout, None)
    with pytest.raises(SpecError, match="field 'eta' must be a number"):
        make_aggregator("fedadam", {"eta": "fast"}, layout, None)
    bad: dict[str, dict[str, Any]] = {
        "fedadam": {"eta": -1.0},
        "fedavgm": {"momentum": 1.0},
        "trimmed_mean": {"beta": 0.5},
        "krum": {"f": -1},
        "multikrum": {"m": 0},
        "centered_clipping": {"iterations": 0},
        "dp_fedavg": {"accountant": "moments"},
        "fedbuff": {"staleness": "linear"},
        "fedprox": {"mu": -0.1},
    }
    for name, params in bad.items():
        (param,) = params
        with pytest.raises(SpecError, match=param):
            make_aggregator(name, params, layout, tmp_path)
    with pytest.raises(SpecError, match="clip_count_stddev"):
        make_aggregator("dp_fedavg", {"adaptive_clip": True}, layout, None)
    with pytest.raises(SpecError, match="spool_dir"):
        make_aggregator("median", {}, layout, None)
    assert strategy_info("median").traits.needs_all_updates
    assert strategy_info("dp_fedavg").traits.needs_sampling_rate
    assert strategy_info("fedbuff").traits.asynchronous
    assert not any(_flags(strategy_info("fedadam").traits))
    for name in STRATEGY_NAMES:
        agg = make_aggregator(name, {}, layout, tmp_path)
        assert isinstance(agg, Aggregator)
        assert type(agg).traits == strategy_info(name).traits
        agg.close()
    prox = make_aggregator("fedprox", {"mu": 0.1}, layout, None)
    assert prox.client_config() == {"proximal_mu": 0.1}


def _flags(traits: Any) -> list[bool]:
    return [traits.needs_all_updates, traits.needs_sampling_rate, traits.asynchronous]


# --- the contract every strategy keeps -------------------------------------------------


def _spoil(kind: str, delta: ModelState) -> tuple[ModelState, float]:
    d = dict(delta)
    if kind in ("nan", "inf"):
        d["scale"] = np.array(np.nan if kind == "nan" else np.inf, dtype=np.float32)
    elif kind == "nan first":
        d["w"] = np.full_like(d["w"], np.nan)
    elif kind == "shape":
        d["b"] = np.zeros(3, dtype=np.float32)
    elif kind == "missing":
        del d["scale"]
    elif kind == "extra":
        d["bias2"] = np.zeros(2, dtype=np.float32)
    return d, {"zero weight": 0.0, "negative weight": -2.0, "nan weight": math.nan}.get(kind, 4.0)


SPOILS = (
    "nan",
    "inf",
    "nan first",
    "shape",
    "missing",
    "extra",
    "zero weight",
    "negative weight",
    "nan weight",
)


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_a_rejected_update_leaves_the_aggregator_untouched(name: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    model = _model(rng)
    good = _deltas(model, rng, 9)
    weights = [float(w) for w in rng.integers(1, 50, size=9)]
    clean = _round(_make(name, model, tmp_path / "a"), model, good, weights)
    agg = _make(name, model, tmp_path / "b")
    if isinstance(agg, DPFedAvg):
        agg.check_budget(0.01)
    agg.begin(1, model)
    for i, (delta, weight) in enumerate(zip(good, weights, strict=True)):
        agg.add(delta, weight)
        if i == 4:
            before = (agg.count, agg.total_weight)
            for kind in SPOILS:
                bad, bad_weight = _spoil(kind, good[0])
                with pytest.raises(UpdateRejected):
                    agg.add(bad, bad_weight)
            assert (agg.count, agg.total_weight) == before
    got = agg.finalize()
    for k in model:
        np.testing.assert_array_equal(got[k], clean[k])
        assert got[k].dtype == model[k].dtype


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_lifecycle_errors(name: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    model = _model(rng)
    agg = _make(name, model, tmp_path)
    with pytest.raises(RuntimeError, match="begin"):
        agg.add(_deltas(model, rng, 1)[0], 1.0)
    if isinstance(agg, DPFedAvg):
        agg.check_budget(0.01)
    agg.begin(1, model)
    with pytest.raises(UpdateRejected, match=r"no updates|at least"):
        agg.finalize()
    with pytest.raises(SpecError):
        agg.begin(2, {"w": model["w"]})
    agg.close()
    agg.close()


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "fedavgm", *FEDOPT, "fedbuff"])
def test_a_non_finite_result_is_refused_and_state_kept(name: str, tmp_path: Path) -> None:
    """Finite updates can still overflow float32 together; such a model is never returned."""
    rng = np.random.default_rng(3)
    model = _model(rng)
    agg = _make(name, model, tmp_path)
    _round(agg, model, _deltas(model, rng, 3), [1.0, 2.0, 3.0])
    saved = {k: v.copy() for k, v in agg.state().items()}
    huge = {k: np.full(v.shape, 3e38, dtype=np.float32) for k, v in model.items()}
    with pytest.raises(UpdateRejected, match="not finite"):
        _round(agg, model, [huge, huge], [1.0, 1.0], round_no=2)
    assert saved.keys() == agg.state().keys()
    for k, v in agg.state().items():
        np.testing.assert_array_equal(v, saved[k])


# --- streaming strategies ---------------------------------------------------------------


def _weighted_mean(updates: list[ModelState], weights: list[float]) -> dict[str, np.ndarray]:
    total = sum(weights)
    return {
        k: sum(w * u[k].astype(np.float64) for u, w in zip(updates, weights, strict=True)) / total
        for k in updates[0]
    }


@pytest.mark.parametrize("name", ["fedavg", "fedprox"])
def test_fedavg_is_the_sample_weighted_mean(name: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    model = _model(rng)
    updates = _deltas(model, rng, 17)
    weights = [float(w) for w in rng.integers(1, 500, size=17)]
    agg = _make(name, model, tmp_path, server_lr=0.7)
    got = _round(agg, model, updates, weights)
    mean = _weighted_mean(updates, weights)
    want = {k: model[k] + 0.7 * mean[k] for k in model}
    assert _rel_err(got, want, model) < 1e-6


def _fedopt_reference(
    name: str,
    model: ModelState,
    rounds: list[tuple[list[ModelState], list[float]]],
    p: dict[str, float],
) -> list[dict[str, dict[str, np.ndarray]]]:
    """Reddi et al. 2021, Algorithm 2 (and Hsu et al. 2019 for FedAvgM), in float64."""
    x = {k: v.astype(np.float64) for k, v in model.items()}
    m = {k: np.zeros(v.shape) for k, v in model.items()}
    v = {k: np.full(val.shape, p.get("tau", 0.0) ** 2) for k, val in model.items()}
    out = []
    for updates, weights in rounds:
        delta = _weighted_mean(updates, weights)
        for k in x:
            d = delta[k]
            if name == "fedavgm":
                m[k] = p["momentum"] * m[k] + d
                x[k] = x[k] + p["server_lr"] * m[k]
                continue
            m[k] = p["beta1"] * m[k] + (1 - p["beta1"]) * d
            if name == "fedadagrad":
                v[k] = v[k] + d**2
            elif name == "fedyogi":
                v[k] = v[k] - (1 - p["beta2"]) * d**2 * np.sign(v[k] - d**2)
            else:
                v[k] = p["beta2"] * v[k] + (1 - p["beta2"]) * d**2
            x[k] = x[k] + p["eta"] * m[k] / (np.sqrt(v[k]) + p["tau"])
        out.append({"x": dict(x), "m": dict(m), "v": dict(v)})
    return out


@pytest.mark.parametrize("name", ["fedavgm", *FEDOPT])
def test_server_optimizers_follow_the_papers_over_rounds(name: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    model = _model(rng)
    if name == "fedavgm":
        params = {"server_lr": 0.3, "momentum": 0.8}
    else:
        params = {"eta": 0.05, "beta1": 0.85, "beta2": 0.95, "tau": 0.05}
    rounds = [
        (_deltas(model, rng, 6, sd=0.3), [float(w) for w in rng.integers(1, 40, 6)])
        for _ in range(5)
    ]
    want = _fedopt_reference(name, model, rounds, params)
    agg = _make(name, model, tmp_path, **params)
    current = model
    for r, (updates, weights) in enumerate(rounds):
        current = _round(agg, current, updates, weights, round_no=r + 1)
        assert _rel_err(current, want[r]["x"], model) < 1e-6
        # The moments themselves, since a small step hides in the model's float32 rounding.
        state = agg.state()
        parts = ("v",) if name == "fedavgm" else ("m", "v")
        for part in parts:
            key = "v" if name == "fedavgm" and part == "v" else part
            got = {k: state[f"{name}/{part}/{k}"] for k in model}
            ref = want[r]["m" if name == "fedavgm" else key]
            assert _rel_err(got, ref, model) < 1e-6, part


STATEFUL = ("fedavgm", *FEDOPT, "centered_clipping", "dp_fedavg")


@pytest.mark.parametrize("name", STATEFUL)
def test_state_round_trip_continues_identically(name: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    model = _model(rng)
    layout = state_spec(model)
    params: dict[str, Any] = {"tau": 3.0, "iterations": 2} if name == "centered_clipping" else {}
    if name == "dp_fedavg":
        params = {**BIG_BUDGET, "adaptive_clip": True, "expected_clients": 40}
    gen = np.random.default_rng(7)
    first = make_aggregator(name, params, layout, tmp_path / "a", rng=gen)
    current = model
    for r in range(3):
        current = _round(first, current, _deltas(model, rng, 5), [1.0, 2.0, 3.0, 4.0, 5.0], r + 1)
        if isinstance(first, DPFedAvg):
            first.spend()
    stored = decode_state(encode_state(first.state()))  # through the wire format and back
    twin_gen = np.random.Generator(np.random.PCG64())
    twin_gen.bit_generator.state = gen.bit_generator.state
    twin = make_aggregator(name, params, layout, tmp_path / "b", rng=twin_gen)
    twin.restore(stored)
    updates = _deltas(model, rng, 5)
    a = _round(first, current, updates, [1.0] * 5, round_no=4)
    b = _round(twin, current, updates, [1.0] * 5, round_no=4)
    for k in model:
        np.testing.assert_array_equal(a[k], b[k])
    for k, v in first.state().items():
        np.testing.assert_array_equal(v, twin.state()[k])
    with pytest.raises(SpecError):
        twin.restore({**stored, "other/x": np.zeros(1)})


# --- robust rules ----------------------------------------------------------------------


def _krum_reference(xs: np.ndarray, f: int, m: int) -> np.ndarray:
    """Blanchard et al. 2017: score = sum of squared distances to the n-f-2 nearest."""
    n = len(xs)
    scores = []
    for i in range(n):
        d = sorted(float(np.sum((xs[i] - xs[j]) ** 2)) for j in range(n) if j != i)
        scores.append(sum(d[: n - f - 2]))
    best = np.argsort(scores, kind="stable")[:m]
    return xs[best].mean(axis=0)


def _cc_reference(xs: np.ndarray, v: np.ndarray, tau: float, iters: int) -> np.ndarray:
    """Karimireddy et al. 2021: v <- v + mean_i (x_i - v) min(1, tau / ||x_i - v||)."""
    for _ in range(iters):
        diffs = xs - v
        norms = np.linalg.norm(diffs, axis=1)
        v = v + np.mean(diffs * np.minimum(1.0, tau / norms)[:, None], axis=0)
    return v


def _robust_reference(name: str, xs: np.ndarray, centre: np.ndarray) -> np.ndarray:
    if name == "median":
        return np.median(xs, axis=0)
    if name == "trimmed_mean":
        k = math.floor(0.2 * len(xs))
        return np.sort(xs, axis=0)[k : len(xs) - k].mean(axis=0)
    if name == "krum":
        return _krum_reference(xs, 2, 1)
    if name == "multikrum":
        return _krum_reference(xs, 2, 4)
    return _cc_reference(xs, centre, 2.5, 3)


ROBUST_PARAMS: dict[str, dict[str, Any]] = {
    "median": {},
    "trimmed_mean": {"beta": 0.2},
    "krum": {"f": 2},
    "multikrum": {"f": 2, "m": 4},
    "centered_clipping": {"tau": 2.5, "iterations": 3},
}


@pytest.mark.parametrize("n", [10, 11])
@pytest.mark.parametrize("name", ROBUST)
def test_robust_rules_match_references(
    name: str, n: int, tmp_path: Path, narrow_columns: None
) -> None:
    rng = np.random.default_rng(8 + n)
    model = _model(rng)
    agg = _make(name, model, tmp_path, server_lr=0.5, **ROBUST_PARAMS[name])
    centre = np.zeros(sum(v.size for v in model.values()))
    current = model
    for r in range(2):  # centered clipping starts round 2 from round 1's result
        updates = _deltas(model, rng, n)
        xs = np.stack([_flat(u, model) for u in updates])
        result = _robust_reference(name, xs, centre)
        centre = result
        want_vec = _flat(current, model) + 0.5 * result
        current = _round(agg, current, updates, [float(i + 1) for i in range(n)], r + 1)
        assert _rel_err(current, _unflat(want_vec, model), model) < 1e-6


def test_krum_needs_2f_plus_3_updates(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    model = _model(rng)
    agg = _make("krum", model, tmp_path, f=2)
    assert isinstance(agg, RobustAggregator) and agg.min_updates == 7
    with pytest.raises(UpdateRejected, match="at least 7"):
        _round(agg, model, _deltas(model, rng, 6), [1.0] * 6)


def _outlier_round(
    kind: str, rng: np.random.Generator, d: int = 2000, n: int = 50
) -> tuple[np.ndarray, list[np.ndarray]]:
    mu = rng.standard_normal(d).astype(np.float32)
    clean = [mu + 0.1 * rng.standard_normal(d).astype(np.float32) for _ in range(n - n // 5)]
    if kind == "noise":
        bad = [(10 * rng.standard_normal(d)).astype(np.float32) for _ in range(n // 5)]
    else:
        bad = [-10 * c for c in clean[: n // 5]]
    return np.mean(clean, axis=0), [*clean, *bad]


@pytest.mark.parametrize("kind", ["noise", "sign flip"])
def test_robust_rules_resist_20_percent_outliers(kind: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(10)
    clean_mean, updates = _outlier_round(kind, rng)
    model = {"w": np.zeros(clean_mean.size, dtype=np.float32)}
    params = {
        **ROBUST_PARAMS,
        "trimmed_mean": {"beta": 0.25},
        "krum": {"f": 10},
        "multikrum": {"f": 10},
        "centered_clipping": {"tau": 5.0, "iterations": 15},
    }
    errors = {}
    for name in ("fedavg", *ROBUST):
        agg = _make(name, model, tmp_path / name, **params.get(name, {}))
        out = _round(agg, model, [{"w": u} for u in updates], [1.0] * len(updates))
        errors[name] = float(np.linalg.norm(out["w"] - clean_mean) / np.linalg.norm(clean_mean))
    assert errors["fedavg"] > 0.5, errors
    for name in ROBUST:
        assert errors[name] < 0.15, errors


def test_the_spool_lives_on_disk_for_the_round_only(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    model = _model(rng)
    spool = tmp_path / "spool"
    spool.mkdir()
    stale = spool / "r3-crashed.flspool"
    stale.write_bytes(b"\0" * 64)  # left by a server killed mid-round
    agg = make_aggregator("median", {}, state_spec(model), spool)
    assert not stale.exists()
    agg.begin(1, model)
    for delta in _deltas(model, rng, 4):
        agg.add(delta, 1.0)
    files = list(spool.iterdir())
    row_bytes = 4 * sum(v.size for v in model.values())
    assert [f.stat().st_size for f in files] == [4 * row_bytes]
    other = make_aggregator("krum", {}, state_spec(model), spool)  # sweeps, but ours is locked
    assert list(spool.iterdir()) == files
    agg.finalize()
    assert list(spool.iterdir()) == []
    other.begin(1, model)
    other.add(_deltas(model, rng, 1)[0], 1.0)
    assert len(list(spool.iterdir())) == 1
    other.close()
    assert list(spool.iterdir()) == []


def test_the_spool_is_bounded(tmp_path: Path) -> None:
    rng = np.random.default_rng(12)
    model = _model(rng)
    layout = state_spec(model)
    agg = make_aggregator("median", {}, layout, tmp_path, spool_limits=SpoolLimits(max_updates=3))
    agg.begin(1, model)
    updates = _deltas(model, rng, 4)
    for delta in updates[:3]:
        agg.add(delta, 1.0)
    with pytest.raises(UpdateRejected, match=r"spool is full: 3 updates .*max_updates=3"):
        agg.add(updates[3], 1.0)
    assert agg.count == 3
    want = np.median(np.stack([_flat(u, model) for u in updates[:3]]), axis=0)
    got = agg.finalize()
    assert _rel_err(got, _unflat(_flat(model, model) + want, model), model) < 1e-6
    with pytest.raises(SpecError, match="max_bytes"):
        make_aggregator("median", {}, layout, tmp_path, spool_limits=SpoolLimits(max_bytes=100))


# --- differential privacy --------------------------------------------------------------


def test_dp_clips_every_update_to_the_norm(tmp_path: Path) -> None:
    rng = np.random.default_rng(13)
    model = {k: np.zeros_like(v) for k, v in _model(rng).items()}
    clip = 2.0
    agg = _make(
        "dp_fedavg", model, tmp_path, clip_norm=clip, noise_multiplier=1e-12, expected_clients=1
    )
    assert isinstance(agg, DPFedAvg)
    agg.check_budget(1.0)
    for scale in np.geomspace(1e-3, 1e3, 40):
        update = {k: (scale * v).astype(np.float32) for k, v in _deltas(model, rng, 1)[0].items()}
        out = _round(agg, model, [update], [123.0])
        norm_in = float(np.linalg.norm(_flat(update, model)))
        norm_out = float(np.linalg.norm(_flat(out, model)))
        assert norm_out <= clip * (1 + 1e-6)
        if norm_in <= clip:  # small updates pass unchanged, whatever their weight
            np.testing.assert_allclose(_flat(out, model), _flat(update, model), rtol=1e-6)


@pytest.mark.parametrize("adaptive", [False, True])
def test_dp_noise_has_the_promised_std(adaptive: bool, tmp_path: Path) -> None:
    model = {"w": np.zeros(64, dtype=np.float32)}
    z, m = 1.3, 8
    params = {
        "noise_multiplier": z,
        "clip_norm": 0.5,
        "expected_clients": m,
        "adaptive_clip": adaptive,
        "clip_count_stddev": 2.0,
    }
    agg = _make("dp_fedavg", model, tmp_path, **params)
    assert isinstance(agg, DPFedAvg)
    z_u = (z**-2 - (2 * 2.0) ** -2) ** -0.5 if adaptive else z
    agg.check_budget(0.01)
    draws = []
    for r in range(200):
        want_std = z_u * agg.clip_norm / m
        zeros = [{"w": np.zeros(64, dtype=np.float32)}] * m  # norm 0: only noise comes out
        draws.append(_round(agg, model, zeros, [1.0] * m, r + 1)["w"] / want_std)
    assert abs(float(np.std(draws)) - 1.0) < 0.1
    if adaptive:  # every update was within the norm: it shrank by about exp(-0.2 * 0.5) a round
        assert agg.clip_norm < 0.5 * math.exp(-15)


def test_adaptive_clip_norm_follows_the_geometric_rule(tmp_path: Path) -> None:
    model = {"w": np.zeros(10, dtype=np.float32)}
    m, sigma_b, eta_c, gamma = 100, 5.0, 0.2, 0.5
    agg = make_aggregator(
        "dp_fedavg",
        {
            **BIG_BUDGET,
            "adaptive_clip": True,
            "expected_clients": m,
            "clip_learning_rate": eta_c,
            "target_quantile": gamma,
        },
        state_spec(model),
        None,
        rng=np.random.default_rng(14),
    )
    assert isinstance(agg, DPFedAvg)
    updates = [{"w": np.full(10, 0.1 if i < 30 else 10.0, dtype=np.float32)} for i in range(m)]
    before = agg.clip_norm
    _round(agg, model, updates, [1.0] * m)
    twin = np.random.default_rng(14)  # replay the draws: update noise first, then the count
    twin.standard_normal(10, dtype=np.float32)
    b = (30 + twin.normal(0.0, sigma_b)) / m
    assert agg.clip_norm == pytest.approx(before * math.exp(-eta_c * (b - gamma)), rel=1e-12)


def test_epsilon_matches_dp_accounting_and_the_budget_holds(tmp_path: Path) -> None:
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    rng = np.random.default_rng(15)
    model = _model(rng)
    z, delta = 1.1, 1e-5
    for kind, cls, rates in (
        ("rdp", rdp_privacy_accountant.RdpAccountant, [0.02, 0.05, 0.02]),
        ("pld", pld_privacy_accountant.PLDAccountant, [0.02, 0.05]),
    ):
        agg = make_aggregator(
            "dp_fedavg",
            {"noise_multiplier": z, "delta": delta, "accountant": kind, "epsilon": 1e6},
            state_spec(model),
            None,
        )
        assert isinstance(agg, DPFedAvg)
        for r, q in enumerate(rates):
            _round(agg, model, _deltas(model, rng, 3), [1.0] * 3, r + 1, q=q)
            eps = agg.spend(q)
            direct = cls()
            for past in rates[: r + 1]:
                gaussian = dp_accounting.GaussianDpEvent(z)
                direct.compose(dp_accounting.PoissonSampledDpEvent(past, gaussian))
            assert eps == pytest.approx(direct.get_epsilon(delta), rel=1e-9)
            assert agg.epsilon == eps

    budget = make_aggregator(
        "dp_fedavg", {"noise_multiplier": z, "epsilon": 3.5}, state_spec(model), None
    )
    assert isinstance(budget, DPFedAvg)
    spent = 0
    while True:
        try:
            budget.check_budget(0.2)
        except BudgetExhausted as exc:
            assert "over the budget of 3.5" in str(exc)
            break
        _round(budget, model, _deltas(model, rng, 2), [1.0, 1.0], spent + 1, q=0.2)
        budget.spend()
        spent += 1
    assert spent == 3 and budget.epsilon <= 3.5  # 2.41, 2.92, 3.28, then 3.58 is refused
    with pytest.raises(RuntimeError, match="check_budget"):  # no noisy release unchecked
        budget.begin(spent + 1, model)
        budget.add(_deltas(model, rng, 1)[0], 1.0)
        budget.finalize()
    restarted = make_aggregator(
        "dp_fedavg", {"noise_multiplier": z, "epsilon": 3.5}, state_spec(model), None
    )
    assert isinstance(restarted, DPFedAvg)
    restarted.restore(decode_state(encode_state(budget.state())))
    assert restarted.epsilon == budget.epsilon
    with pytest.raises(BudgetExhausted):
        restarted.check_budget(0.2)
    assert restarted.check_budget(0.01) < 3.5  # a smaller sampling rate still fits


# --- FedBuff ---------------------------------------------------------------------------


def test_fedbuff_commits_every_k_with_staleness_weights() -> None:
    rng = np.random.default_rng(16)
    model = _model(rng)
    params = FedBuffParams(
        buffer_size=3, server_lr=0.8, staleness="polynomial", exponent=0.5, max_staleness=5
    )
    agg = FedBuff(state_spec(model), params)
    agg.begin(7, model)
    current = {k: v.astype(np.float64) for k, v in model.items()}
    for version in (7, 8):
        assert agg.version == version
        batch = [
            (u, float(rng.integers(1, 9)), int(rng.integers(0, 5))) for u in _deltas(model, rng, 3)
        ]
        for i, (u, w, tau) in enumerate(batch):
            assert not agg.ready()
            agg.add(u, w, staleness=tau)
            assert agg.ready() == (i == 2)
        total = sum(w for _, w, _ in batch)
        current = {
            k: current[k] + 0.8 * sum(w * (1 + tau) ** -0.5 * u[k] for u, w, tau in batch) / total
            for k in model
        }
        got = agg.finalize()
        assert _rel_err(got, current, model) < 1e-6
    with pytest.raises(UpdateRejected, match="stale"):
        agg.add(_deltas(model, rng, 1)[0], 1.0, staleness=6)
    with pytest.raises(UpdateRejected, match="staleness"):
        agg.add(_deltas(model, rng, 1)[0], 1.0, staleness=-1)
    assert agg.count == 0


def test_staleness_functions() -> None:
    from flotilla.aggregation import staleness_weight

    const = FedBuffParams(staleness="constant")
    poly = FedBuffParams(staleness="polynomial", exponent=2.0)
    hinge = FedBuffParams(staleness="hinge", hinge_a=10.0, hinge_b=4)
    assert [staleness_weight(const, t) for t in (0, 9)] == [1.0, 1.0]
    assert [staleness_weight(poly, t) for t in (0, 1, 3)] == [1.0, 0.25, 1 / 16]
    assert [staleness_weight(hinge, t) for t in (0, 4, 5, 6)] == [1.0, 1.0, 1 / 11, 1 / 21]


# --- hygiene ---------------------------------------------------------------------------


def test_importing_aggregation_loads_no_heavy_packages() -> None:
    code = "import json, sys, flotilla.aggregation; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        bound([sys.executable, "-c", code]),
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = json.loads(out.stdout)
    heavy = ("torch", "scipy", "dp_accounting", "flotilla.server", "flotilla.engine")
    assert [m for m in loaded if m.split(".")[0] in heavy or m.startswith(heavy)] == []


def test_params_classes_are_frozen_dataclasses() -> None:
    import dataclasses

    for name in STRATEGY_NAMES:
        cls = strategy_info(name).params
        assert dataclasses.is_dataclass(cls)
        instance = cls()
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(instance, dataclasses.fields(cls)[0].name, 2.0)


LINEAR = ("fedavg", "fedprox", "fedavgm", *FEDOPT, "dp_fedavg")


@pytest.mark.parametrize(("name", "adaptive"), [*((n, False) for n in LINEAR), ("dp_fedavg", True)])
def test_partial_sums_folded_elsewhere_equal_adding_each_update(
    name: str, adaptive: bool, tmp_path: Path
) -> None:
    """What simulation workers do: each folds its slice with the strategy's own ``add``
    and hands out a partial; the server's aggregator takes the merged partials. Two
    rounds (server state such as moments and DP's clip norm carries over) end where
    adding every update one by one ends, to float summation."""
    rng = np.random.default_rng(5)
    model = _model(rng)
    params = {"adaptive_clip": True, "clip_norm": 3.0, "clip_count_stddev": 1.0} if adaptive else {}
    direct, folded = (_make(name, model, tmp_path / side, **params) for side in "ab")
    for round_no in (1, 2):
        deltas = _deltas(model, rng, 7)
        weights = [float(w) for w in rng.integers(5, 50, size=7)]
        want = _round(direct, model, deltas, weights, round_no)
        if isinstance(folded, DPFedAvg):
            folded.check_budget(0.01)
        folded.begin(round_no, model)
        parts = []
        assert isinstance(folded, FoldsPartials)
        overrides = folded.fold_overrides()
        for lo, hi in ((0, 3), (3, 7)):  # two workers' slices
            worker = _make(name, model, tmp_path / f"w{lo}", **{**params, **overrides})
            worker.begin(round_no, model)
            for delta, weight in zip(deltas[lo:hi], weights[lo:hi], strict=True):
                worker.add(delta, weight)
            assert isinstance(worker, MakesPartials)
            parts.append(worker.partial())
        folded.add_partial(merge_partials(parts))
        assert folded.count == 7 and folded.total_weight == pytest.approx(
            direct_weight(name, weights)
        )
        got = folded.finalize()
        assert _rel_err(got, want, model) < 1e-6
        model = want


def direct_weight(name: str, weights: list[float]) -> float:
    """The total weight a round of ``weights`` holds (DP-FedAvg weighs every update 1)."""
    return float(len(weights)) if name == "dp_fedavg" else sum(weights)


@pytest.mark.parametrize("name", ["fedavg", "dp_fedavg"])
def test_a_partial_that_is_not_finite_or_empty_is_refused_and_changes_nothing(
    name: str, tmp_path: Path
) -> None:
    rng = np.random.default_rng(6)
    model = _model(rng)
    agg = _make(name, model, tmp_path)
    agg.begin(1, model)
    assert isinstance(agg, FoldsPartials)
    delta = _deltas(model, rng, 1)[0]
    bad = {k: v.copy() for k, v in delta.items()}
    bad["w"][0, 0] = np.nan
    for partial in (PartialSum(bad, 1.0, 1), PartialSum(delta, 1.0, 0)):
        with pytest.raises(UpdateRejected):
            agg.add_partial(partial)
    assert agg.count == 0 and agg.total_weight == 0.0


def test_robust_rules_do_not_fold_partials(tmp_path: Path) -> None:
    """Order statistics need every update: their aggregators offer no partials, so
    simulation workers ship each delta to the parent."""
    model = _model(np.random.default_rng(7))
    for name in ROBUST:
        agg = _make(name, model, tmp_path / name)
        assert not isinstance(agg, FoldsPartials | MakesPartials), name
