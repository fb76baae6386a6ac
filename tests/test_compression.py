"""Update codecs: error bounds, unbiasedness, exact top-k, error feedback, hostile payloads."""

from __future__ import annotations

import json
import logging
import math
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from flotilla.compression import (
    CODEC_NAMES,
    Codec,
    CodecContext,
    ErrorFeedback,
    decode_state_with,
    encode_state_with,
    make_codec,
    max_payload_bytes,
    theoretical_bytes,
)
from flotilla.compression.bits import sample_indices
from flotilla.compression.codec import count_of
from flotilla.core.errors import SpecError, UpdateRejected, WireError
from flotilla.core.tensors import TensorSpec, encode_state, read_metadata

FAST = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

#: The digits MLP (64-256-128-10) the demos train.
DIGITS = (
    TensorSpec("fc1.weight", "F32", (256, 64)),
    TensorSpec("fc1.bias", "F32", (256,)),
    TensorSpec("fc2.weight", "F32", (128, 256)),
    TensorSpec("fc2.bias", "F32", (128,)),
    TensorSpec("fc3.weight", "F32", (10, 128)),
    TensorSpec("fc3.bias", "F32", (10,)),
)
ONE_MILLION = (TensorSpec("w", "F32", (1000, 1000)),)

#: One instance of every codec, with small blocks so that odd sizes straddle them.
CODECS: list[tuple[str, dict[str, Any]]] = [
    ("none", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("int8", {}),
    ("int8", {"block_size": 7}),
    ("int4", {}),
    ("int4", {"block_size": 5}),
    ("qsgd", {}),
    ("qsgd", {"s": 1, "bucket_size": 9, "norm": "max"}),
    ("qsgd", {"s": 20, "bucket_size": 64}),
    ("topk", {}),
    ("topk", {"fraction": 0.3, "values": "F16"}),
    ("randk", {}),
    ("randk", {"fraction": 0.5, "unbiased": True}),
]
CODEC_IDS = [f"{n}{p}" for n, p in CODECS]

shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40)
magnitudes = st.sampled_from([0.0, 1e-40, 1e-30, 1e-3, 1.0, 1e3, 1e30, 1e37])


@st.composite
def tensors(draw: st.DrawFn) -> np.ndarray:
    """Arrays in float16/32/64 mixing zeros, tiny, ordinary and huge (1e30) values."""
    dtype = draw(st.sampled_from([np.float32, np.float16, np.float64]))
    shape = draw(shapes)
    scale = draw(magnitudes)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    x = np.asarray(rng.standard_normal(shape) * scale, np.float64)
    if draw(st.booleans()) and x.size:
        x.reshape(-1)[rng.random(x.size) < 0.3] = 0.0
    if draw(st.booleans()) and x.size:
        x.reshape(-1)[rng.integers(x.size)] = draw(st.sampled_from([1e30, -1e30, 65504.0, 7e4]))
    np.clip(x, -3e38, 3e38, out=x)  # finite in float32
    with np.errstate(over="ignore"):
        out = x.astype(dtype)
    out[~np.isfinite(out)] = 0.0
    return out


def roundtrip(codec: Codec, x: np.ndarray, seed: int = 0) -> np.ndarray:
    y = codec.decode(codec.encode(x, CodecContext.seeded(seed)))
    assert y.dtype == np.float32 and y.shape == x.shape
    return y


# --- round-trip error bounds ----------------------------------------------------------------


@FAST
@given(x=tensors())
def test_none_is_exact_in_float32(x: np.ndarray) -> None:
    assert np.array_equal(roundtrip(make_codec("none"), x), x.astype(np.float32))


@FAST
@given(x=tensors())
def test_fp16_relative_bound_and_saturation(x: np.ndarray) -> None:
    x32 = x.astype(np.float32).astype(np.float64)
    y = roundtrip(make_codec("fp16"), x).astype(np.float64)
    inside = np.abs(x32) <= 65504
    err = np.abs(y - x32)
    assert (err[inside] <= 2**-11 * np.abs(x32[inside]) + 2**-25).all()
    assert (y[~inside] == np.sign(x32[~inside]) * 65504).all()


@FAST
@given(x=tensors())
def test_bf16_relative_bound(x: np.ndarray) -> None:
    x32 = x.astype(np.float32).astype(np.float64)
    y = roundtrip(make_codec("bf16"), x).astype(np.float64)
    assert (np.abs(y - x32) <= 2**-8 * np.abs(x32) + 2**-133).all()


def test_bf16_rounds_to_nearest_even_and_saturates() -> None:
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, 3.4e38, -3.4e38], np.float32)
    y = roundtrip(make_codec("bf16"), x)
    bf16_max = np.float32(3.3895313892515355e38)
    assert y.tolist() == [1.0, 1 + 2**-6, 1 + 2**-7, bf16_max, -bf16_max]


@FAST
@given(x=tensors(), name=st.sampled_from(["int8", "int4"]), bs=st.sampled_from([1, 3, 64, 256]))
def test_blockwise_absmax_bound(x: np.ndarray, name: str, bs: int) -> None:
    codec = make_codec(name, {"block_size": bs})
    levels = 127 if name == "int8" else 7
    x32 = x.astype(np.float32).reshape(-1).astype(np.float64)
    y = roundtrip(codec, x).reshape(-1).astype(np.float64)
    pad = -x32.size % bs
    absmax = np.abs(np.concatenate([x32, np.zeros(pad)])).reshape(-1, bs).max(axis=1)
    # Half a step, plus the float32 rounding of x / scale: near a half-way point (122.5
    # steps, say) a few ulps of |x| decide which way it rounds.
    ulps = 4 * float(np.finfo(np.float32).eps) * np.abs(x32)
    bound = np.repeat(absmax / (2 * levels), bs)[: x32.size] * (1 + 1e-5) + ulps + 1e-42
    assert (np.abs(y - x32) <= bound).all()


@FAST
@given(x=tensors(), codec=st.sampled_from([c for c in CODECS if c[0] == "qsgd"]))
def test_qsgd_lands_on_a_neighbouring_level(
    x: np.ndarray, codec: tuple[str, dict[str, Any]]
) -> None:
    c = make_codec(*codec)
    s, d = c.params()["s"], c.params()["bucket_size"]
    x32 = x.astype(np.float32).reshape(-1).astype(np.float64)
    y = roundtrip(c, x).reshape(-1).astype(np.float64)
    padded = np.concatenate([x32, np.zeros(-x32.size % d)]).reshape(-1, d)
    if c.params()["norm"] == "l2":
        norms = np.sqrt((padded**2).sum(axis=1))
    else:
        norms = np.abs(padded).max(axis=1)
    if (norms > np.finfo(np.float32).max).any():
        with pytest.raises(UpdateRejected, match="norm='max'"):
            c.encode(x)
        return
    step = np.repeat(norms / s, d)[: x32.size]
    assert (np.abs(y - x32) <= step * (1 + 1e-5) + 1e-42).all()
    assert (np.sign(y) * np.sign(x32) >= 0).all()


@pytest.mark.parametrize("norm", ["l2", "max"])
def test_qsgd_is_unbiased_with_bounded_variance(norm: str) -> None:
    codec = make_codec("qsgd", {"s": 3, "bucket_size": 64, "norm": norm})
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(100) * rng.choice([0, 1, 100], 100)).astype(np.float32)
    draws = np.stack([roundtrip(codec, x, seed) for seed in range(3000)]).astype(np.float64)
    x64 = x.astype(np.float64)
    buckets = [slice(0, 64), slice(64, 100)]
    for b in buckets:
        xb = x64[b]
        scale = np.sqrt((xb**2).sum()) if norm == "l2" else np.abs(xb).max()
        sigma = scale / 3 / 2 / math.sqrt(len(draws))  # level spacing / 2, per element
        assert (np.abs(draws[:, b].mean(axis=0) - xb) <= 5 * sigma + 1e-6).all()
        mse = ((draws[:, b] - xb) ** 2).sum(axis=1).mean()
        d = xb.size
        if norm == "l2":  # Alistarh et al., Lemma 3.1
            bound = min(d / 9, math.sqrt(d) / 3) * (xb**2).sum()
        else:
            bound = d * (scale / 3) ** 2 / 4
        assert mse <= bound * 1.05


@FAST
@given(x=tensors(), fraction=st.sampled_from([0.01, 0.1, 0.37, 1.0]))
def test_topk_keeps_exactly_the_k_largest_exactly(x: np.ndarray, fraction: float) -> None:
    codec = make_codec("topk", {"fraction": fraction})
    flat = x.astype(np.float32).reshape(-1)
    idx = codec.encode_pieces(flat, CodecContext()).get("idx")
    y = roundtrip(codec, x).reshape(-1)
    k = count_of(fraction, flat.size)
    assert idx is not None and idx.size == k == np.unique(idx).size
    assert np.array_equal(y[idx], flat[idx])
    rest = np.ones(flat.size, bool)
    rest[idx] = False
    assert not y[rest].any()
    if k and rest.any():
        assert np.abs(flat[idx]).min() >= np.abs(flat[rest]).max()


def test_topk_fast_path_matches_a_full_sort() -> None:
    rng = np.random.default_rng(3)
    for x in (
        rng.standard_normal(1_000_003).astype(np.float32),
        np.repeat(rng.standard_normal(1000), 1000).astype(np.float32),  # heavy ties
        np.where(np.arange(600_000) % 7 == 0, 1e30, 1.0).astype(np.float32),  # periodic
    ):
        for fraction in (0.01, 0.1):
            codec = make_codec("topk", {"fraction": fraction})
            idx = codec.encode_pieces(x, CodecContext())["idx"]
            k = count_of(fraction, x.size)
            kth = np.sort(np.abs(x))[-k]
            assert idx.size == k == np.unique(idx).size
            assert np.abs(x[idx]).min() == kth


@FAST
@given(x=tensors(), codec=st.sampled_from([c for c in CODECS if c[0] == "randk"]))
def test_randk_keeps_seeded_indices(x: np.ndarray, codec: tuple[str, dict[str, Any]]) -> None:
    c = make_codec(*codec)
    flat = x.astype(np.float32).reshape(-1)
    pieces = c.encode_pieces(flat, CodecContext.seeded(5))
    k = count_of(c.params()["fraction"], flat.size)
    idx = sample_indices(int(pieces["seed"][0]), flat.size, k)
    assert np.unique(idx).size == k and (idx < max(flat.size, 1)).all()
    y = c.decode_pieces(pieces, flat.size)
    gain = flat.size / k if c.params()["unbiased"] and k else 1.0
    assert np.array_equal(y[idx], (flat[idx] * np.float32(gain)).astype(np.float32))
    assert np.count_nonzero(y) <= k


def test_randk_unbiased_mean_and_index_spread() -> None:
    codec = make_codec("randk", {"fraction": 0.25, "unbiased": True})
    x = np.linspace(-2, 2, 20).astype(np.float32)
    draws = np.stack([roundtrip(codec, x, seed) for seed in range(4000)])
    sigma = np.abs(x) * math.sqrt(3 / 4000)
    assert (np.abs(draws.mean(axis=0) - x) <= 5 * sigma + 1e-6).all()
    hits = np.bincount(np.concatenate([sample_indices(s, 1000, 10) for s in range(2000)]))
    assert hits.size == 1000 and hits.min() > 5 and hits.max() < 45  # about 20 each


def test_encode_refuses_nan_and_inf() -> None:
    for name in CODEC_NAMES:
        for bad in (np.nan, np.inf):
            with pytest.raises(UpdateRejected, match="NaN or Inf"):
                make_codec(name).encode(np.array([1.0, bad], np.float32))
        with pytest.raises(UpdateRejected):  # 1e300 is not a float32
            make_codec(name).encode(np.array([1e300]))


def test_qsgd_l2_norm_overflow_is_refused_but_max_norm_works() -> None:
    x = np.full(4, 3e38, np.float32)
    with pytest.raises(UpdateRejected, match="norm='max'"):
        make_codec("qsgd").encode(x)
    assert np.array_equal(roundtrip(make_codec("qsgd", {"norm": "max"}), x), x)


# --- codec registry ------------------------------------------------------------------------


def test_codec_names_and_errors_that_name_the_problem() -> None:
    assert CODEC_NAMES == ("none", "fp16", "bf16", "int8", "int4", "qsgd", "topk", "randk")
    with pytest.raises(SpecError, match="valid codecs: none, fp16, bf16, int8"):
        make_codec("zip")
    with pytest.raises(SpecError, match=r"unknown parameter 'k'.*fraction"):
        make_codec("topk", {"k": 3})
    bad: list[tuple[str, dict[str, Any], str]] = [
        ("int8", {"block_size": 0}, "block_size"),
        ("int4", {"block_size": 2.0}, "block_size"),
        ("qsgd", {"s": 128}, "'s'"),
        ("qsgd", {"norm": "l1"}, "norm"),
        ("topk", {"fraction": 0}, "fraction"),
        ("topk", {"fraction": math.nan}, "fraction"),
        ("topk", {"values": "F64"}, "values"),
        ("randk", {"unbiased": 1}, "unbiased"),
    ]
    for name, params, field in bad:
        with pytest.raises(SpecError, match=field):
            make_codec(name, params)


# --- whole-model payloads ------------------------------------------------------------------


def _delta(layout: tuple[TensorSpec, ...], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {s.name: (rng.standard_normal(s.shape) * 0.01).astype(np.float32) for s in layout}


@pytest.mark.parametrize(("name", "params"), CODECS, ids=CODEC_IDS)
def test_state_roundtrip_in_layout_order(name: str, params: dict[str, Any]) -> None:
    codec = make_codec(name, params)
    delta = _delta(DIGITS)
    payload = encode_state_with(codec, delta, CodecContext.seeded(0))
    layout = tuple(reversed(DIGITS))
    out = decode_state_with(payload, layout, 1 << 30)
    assert list(out) == [s.name for s in layout]
    for spec in layout:
        assert out[spec.name].dtype == np.float32 and out[spec.name].shape == spec.shape
        single = codec.decode_pieces(
            codec.encode_pieces(delta[spec.name].reshape(-1), CodecContext()), delta[spec.name].size
        )
        if name not in ("qsgd", "randk"):  # deterministic codecs agree with the per-tensor path
            assert np.array_equal(out[spec.name].reshape(-1), single)
    meta = read_metadata(payload, 1 << 30)
    assert meta["codec"] == name and json.loads(meta["params"]) == codec.params()
    assert len(payload) <= max_payload_bytes(codec, DIGITS)


@pytest.mark.parametrize(("name", "params"), CODECS, ids=CODEC_IDS)
@pytest.mark.parametrize("layout", [DIGITS, ONE_MILLION], ids=["digits", "1M"])
def test_payload_size_is_within_5_percent_of_theory(
    name: str, params: dict[str, Any], layout: tuple[TensorSpec, ...]
) -> None:
    codec = make_codec(name, params)
    payload = encode_state_with(codec, _delta(layout), CodecContext.seeded(0))
    theory = theoretical_bytes(codec, layout)
    assert abs(len(payload) - theory) <= 0.05 * theory, (len(payload), theory)
    assert len(payload) <= max_payload_bytes(codec, layout)


def test_decode_insists_on_the_jobs_codec_when_asked() -> None:
    payload = encode_state_with(make_codec("int8"), _delta(DIGITS))
    decode_state_with(payload, DIGITS, 1 << 30, codec=make_codec("int8"))
    with pytest.raises(WireError, match="expects 'topk'"):
        decode_state_with(payload, DIGITS, 1 << 30, codec=make_codec("topk"))
    with pytest.raises(WireError, match="expects 'int8'"):
        decode_state_with(payload, DIGITS, 1 << 30, codec=make_codec("int8", {"block_size": 64}))


# --- error feedback ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params"), [c for c in CODECS if c[0] != "none"], ids=CODEC_IDS[1:]
)
def test_error_feedback_telescopes(name: str, params: dict[str, Any], tmp_path: Path) -> None:
    codec = make_codec(name, params)
    layout = DIGITS[:2]
    fb = ErrorFeedback("job-1", tmp_path)
    ctx = CodecContext.seeded(0)
    sent = {s.name: np.zeros(s.shape) for s in layout}
    total = {s.name: np.zeros(s.shape) for s in layout}
    for step in range(6):
        delta = _delta(layout, step)
        out = decode_state_with(encode_state_with(codec, delta, ctx, fb), layout, 1 << 30)
        for s in layout:
            sent[s.name] += out[s.name]
            total[s.name] += delta[s.name]
    for s in layout:
        residual = fb.residual(s.name, s.shape)
        assert residual is not None
        scale = np.abs(total[s.name]).max()
        np.testing.assert_allclose(sent[s.name], total[s.name] - residual, atol=1e-5 * scale)
    reloaded = ErrorFeedback.load("job-1", tmp_path, layout)
    assert len(reloaded) == len(layout)
    for s in layout:
        mine, theirs = reloaded.residual(s.name, s.shape), fb.residual(s.name, s.shape)
        assert mine is not None and theirs is not None and np.array_equal(mine, theirs)
    # The same next step from the reloaded residuals: a restart loses nothing.
    nxt = _delta(layout, 99)
    a = encode_state_with(codec, nxt, CodecContext.seeded(7), fb)
    b = encode_state_with(codec, nxt, CodecContext.seeded(7), reloaded)
    assert a == b


def test_error_feedback_file_is_private_atomic_and_per_job(tmp_path: Path) -> None:
    codec = make_codec("topk")
    encode_state_with(codec, _delta(DIGITS), feedback=ErrorFeedback("a", tmp_path))
    encode_state_with(codec, _delta(DIGITS), feedback=ErrorFeedback("b/../c", tmp_path))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and all(
        f.startswith("ef-") and f.endswith(".safetensors") for f in files
    )
    for f in tmp_path.iterdir():
        assert f.stat().st_mode & 0o777 == 0o600
    assert len(ErrorFeedback.load("a", tmp_path)) == len(DIGITS)
    assert len(ErrorFeedback.load("nope", tmp_path)) == 0
    fb = ErrorFeedback.load("a", tmp_path)
    fb.clear()
    assert len(list(tmp_path.iterdir())) == 1


def test_error_feedback_drops_bad_residuals_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fb = ErrorFeedback("job", tmp_path)
    fb.load_state_dict({"fc1.bias": np.ones(256, np.float32), "gone": np.ones(3, np.float32)})
    fb.save()
    path = fb.path
    assert path is not None
    with caplog.at_level(logging.WARNING):
        changed = (TensorSpec("fc1.bias", "F32", (128,)),)
        assert len(ErrorFeedback.load("job", tmp_path, changed)) == 0
        assert "dropping residual 'fc1.bias'" in caplog.text
        loose = ErrorFeedback.load("job", tmp_path)  # no layout: checked when used
        assert loose.residual("fc1.bias", (128,)) is None
        assert "dropped" in caplog.text
        path.write_bytes(path.read_bytes()[:-5])
        assert len(ErrorFeedback.load("job", tmp_path)) == 0
        assert "corrupt" in caplog.text
        path.write_bytes(encode_state({"fc1.bias": np.ones(256, np.float32)}))
        assert len(ErrorFeedback.load("job", tmp_path)) == 0  # no job id: not ours
        assert "not for job" in caplog.text


# --- hostile payloads ----------------------------------------------------------------------

SMALL = (TensorSpec("a", "F32", (3, 70)), TensorSpec("b", "F32", ()), TensorSpec("c", "F32", (0,)))


def _split(payload: bytes) -> tuple[dict[str, Any], bytes]:
    (hlen,) = struct.unpack("<Q", payload[:8])
    return json.loads(payload[8 : 8 + hlen]), payload[8 + hlen :]


def _join(header: dict[str, Any], data: bytes) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _decodes_or_wire_error(payload: bytes, layout: tuple[TensorSpec, ...]) -> None:
    """A hostile payload may decode (a flipped value is still a value) or raise WireError;
    nothing else, and what decodes has the layout's shapes and is finite float32."""
    try:
        out = decode_state_with(payload, layout, 1 << 24)
    except WireError:
        return
    assert list(out) == [s.name for s in layout]
    for s in layout:
        assert out[s.name].shape == s.shape and out[s.name].dtype == np.float32
        assert np.isfinite(out[s.name]).all()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=6,
)


@settings(FAST, max_examples=300)
@given(
    codec=st.sampled_from(CODECS),
    op=st.sampled_from(["flip", "truncate", "extend", "header"]),
    data=st.data(),
)
def test_corrupted_payloads_raise_only_wire_error(
    codec: tuple[str, dict[str, Any]], op: str, data: st.DataObject
) -> None:
    c = make_codec(*codec)
    payload = encode_state_with(c, _delta(SMALL), CodecContext.seeded(1))
    if op == "flip":
        pos = data.draw(st.integers(0, len(payload) - 1))
        bit = data.draw(st.integers(0, 7))
        bad = bytearray(payload)
        bad[pos] ^= 1 << bit
        payload = bytes(bad)
    elif op == "truncate":
        payload = payload[: data.draw(st.integers(0, len(payload) - 1))]
    elif op == "extend":
        payload += data.draw(st.binary(min_size=1, max_size=64))
    else:
        header, body = _split(payload)
        key = data.draw(st.sampled_from(sorted(header)))
        entry = header[key]
        field = data.draw(st.sampled_from([*sorted(entry), "<whole>", "<drop>"]))
        if field == "<drop>":
            del header[key]
        elif field == "<whole>":
            header[key] = data.draw(json_values)
        elif key == "__metadata__" and field == "codec":
            entry[field] = data.draw(st.sampled_from([*CODEC_NAMES, "zip", ""]))
        elif key == "__metadata__" and field == "params":
            entry[field] = json.dumps(data.draw(json_values))
        else:
            entry[field] = data.draw(json_values)
        payload = _join(header, body)
    _decodes_or_wire_error(payload, SMALL)


@pytest.mark.parametrize(("name", "params"), CODECS, ids=CODEC_IDS)
def test_every_truncation_is_a_wire_error(name: str, params: dict[str, Any]) -> None:
    payload = encode_state_with(make_codec(name, params), _delta(SMALL), CodecContext.seeded(1))
    for cut in range(0, len(payload), 7):
        with pytest.raises(WireError):
            decode_state_with(payload[:cut], SMALL, 1 << 24)


def _with_piece(payload: bytes, piece: str, fill: bytes) -> bytes:
    """The payload with the start of one piece's data overwritten."""
    header, body = _split(payload)
    begin, end = header[piece]["data_offsets"]
    assert end - begin >= len(fill)
    body = body[:begin] + fill + body[begin + len(fill) :]
    return _join(header, body)


@pytest.mark.parametrize(
    ("name", "piece", "fill", "message"),
    [
        ("int8", "a::scale", struct.pack("<f", math.nan), "scale"),
        ("int8", "a::scale", struct.pack("<f", -1.0), "scale"),
        ("int8", "a::scale", struct.pack("<f", 3e38), "scale"),
        ("int8", "a::q", b"\x80", "-128"),
        ("int4", "a::q", b"\x00", "nibble"),
        ("qsgd", "a::norm", struct.pack("<f", math.inf), "norm"),
        ("qsgd", "a::codes", b"\xff", "code above"),
        ("topk", "a::idx", b"\xff\xff", "out of range"),
        ("topk", "a::values", struct.pack("<f", math.nan), "NaN"),
        ("randk", "a::values", struct.pack("<f", math.inf), "NaN"),
        ("none", "a::data", struct.pack("<f", math.nan), "NaN"),
        ("fp16", "a::data", b"\x00\x7c", "NaN"),
        ("bf16", "a::bits", b"\x80\x7f", "NaN"),
    ],
)
def test_bad_piece_contents_are_named(name: str, piece: str, fill: bytes, message: str) -> None:
    payload = encode_state_with(make_codec(name), _delta(SMALL), CodecContext.seeded(1))
    with pytest.raises(WireError, match=message):
        decode_state_with(_with_piece(payload, piece, fill), SMALL, 1 << 24)


def test_header_lies_are_refused_before_allocating() -> None:
    payload = encode_state_with(make_codec("topk"), _delta(SMALL))
    header, body = _split(payload)
    header["a::idx"]["shape"] = [10**9]
    with pytest.raises(WireError):
        decode_state_with(_join(header, body), SMALL, 1 << 24)
    header, body = _split(payload)
    header["__metadata__"]["codec"] = "zip"
    with pytest.raises(WireError, match="unknown codec 'zip'"):
        decode_state_with(_join(header, body), SMALL, 1 << 24)
    header, body = _split(payload)
    del header["__metadata__"]
    with pytest.raises(WireError, match="format"):
        decode_state_with(_join(header, body), SMALL, 1 << 24)
    header, body = _split(payload)
    header["__metadata__"]["params"] = json.dumps({"fraction": 1e-9})
    with pytest.raises(WireError, match="piece"):
        decode_state_with(_join(header, body), SMALL, 1 << 24)
    with pytest.raises(WireError, match="exceeds"):
        decode_state_with(payload, SMALL, len(payload) - 1)
    with pytest.raises(WireError, match="pieces differ"):
        decode_state_with(payload, (*SMALL, TensorSpec("d", "F32", (2,))), 1 << 24)


@settings(FAST, max_examples=150)
@given(codec=st.sampled_from(CODECS), x=tensors(), data=st.data())
def test_single_tensor_payloads_are_checked_too(
    codec: tuple[str, dict[str, Any]], x: np.ndarray, data: st.DataObject
) -> None:
    c = make_codec(*codec)
    payload = bytearray(c.encode(x, CodecContext.seeded(2)))
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, len(payload) - 1))
        payload[pos] ^= 1 << data.draw(st.integers(0, 7))
    try:
        y = c.decode(bytes(payload), max_elements=1 << 16)
    except WireError:
        return
    assert y.dtype == np.float32 and np.isfinite(y).all()


def test_single_tensor_decode_bounds_the_shape() -> None:
    payload = make_codec("topk").encode(np.zeros(5000, np.float32))
    with pytest.raises(WireError, match="exceeds 100 elements"):
        make_codec("topk").decode(payload, max_elements=100)
    with pytest.raises(WireError, match="expected 'int8'"):
        make_codec("int8").decode(payload)


def test_the_docs_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    doc = Path(__file__).parent.parent / "docs" / "compression.md"
    example = re.search(r"## Example\n\n```python\n(.*?)```", doc.read_text(), re.S)
    assert example is not None
    exec(compile(example.group(1), str(doc), "exec"), {})
    assert "bytes instead of 33280" in capsys.readouterr().out
