"""The tensor wire format: real safetensors, zero-copy on the way in, and safe on hostile bytes."""

from __future__ import annotations

import json
import random
import re
import struct

import numpy as np
import pytest
import safetensors.numpy as st

from flotilla.core.errors import FlotillaError, UpdateRejected, WireError
from flotilla.core.tensors import (
    MAX_HEADER_BYTES,
    TensorSpec,
    check_finite,
    check_layout,
    decode_state,
    encode_state,
    state_nbytes,
    state_spec,
)

DTYPES = [np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8, np.uint8]
SHAPES = [(), (0,), (3, 0, 2), (5,), (2, 3, 4)]


def _array(dtype: type, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    return (rng.standard_normal(shape) * 50).astype(dtype)


def _frame(header: object, data: bytes = b"") -> bytes:
    """A safetensors buffer with an arbitrary (possibly hostile) header."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _one(dtype: str = "F32", shape: object = (1,), offsets: object = (0, 4)) -> dict:
    shape = list(shape) if isinstance(shape, tuple) else shape
    offsets = list(offsets) if isinstance(offsets, tuple) else offsets
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def _sample_state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((4, 3)).astype(np.float32),
        "b": np.arange(3, dtype=np.int64),
        "scale": np.array(2.5, dtype=np.float64),
        "mask": np.array([True, False, True]),
        "none": np.zeros((0, 2), dtype=np.float16),
    }


# --- round trip -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_keeps_values_dtype_and_shape(dtype: type, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(1)
    state = {"t": _array(dtype, shape, rng), "other": _array(np.float32, (2,), rng)}
    out = decode_state(encode_state(state))
    assert list(out) == ["t", "other"]
    for name, arr in state.items():
        assert out[name].dtype == arr.dtype
        assert out[name].shape == arr.shape
        np.testing.assert_array_equal(out[name], arr)


def test_round_trip_bool_and_empty_state() -> None:
    mask = np.array([[True, False], [False, True]])
    assert np.array_equal(decode_state(encode_state({"m": mask}))["m"], mask)
    assert decode_state(encode_state({})) == {}


def test_encode_handles_non_contiguous_and_big_endian_input() -> None:
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    big = np.arange(5, dtype=">i4")
    out = decode_state(encode_state({"t": base.T, "s": base[:, ::2], "big": big}))
    np.testing.assert_array_equal(out["t"], base.T)
    np.testing.assert_array_equal(out["s"], base[:, ::2])
    np.testing.assert_array_equal(out["big"], big)
    assert out["big"].dtype == np.dtype("<i4")


@pytest.mark.parametrize("dtype", [np.complex64, np.uint32, object])
def test_encode_refuses_dtypes_that_cannot_travel(dtype: type) -> None:
    with pytest.raises(WireError, match="cannot travel"):
        encode_state({"x": np.zeros(2, dtype=dtype)})


def test_decoded_arrays_are_read_only_zero_copy_views() -> None:
    state = {"a": np.arange(4, dtype=np.float32), "b": np.ones(3, dtype=np.float32)}
    buf = bytearray(encode_state(state))
    out = decode_state(buf)
    assert not out["a"].flags.writeable and not out["b"].flags.writeable
    with pytest.raises(ValueError):
        out["b"][0] = 5.0
    # Zero-copy: the arrays see the buffer they were decoded from.
    buf[-4:] = struct.pack("<f", 7.0)
    assert out["b"][-1] == 7.0
    assert not decode_state(bytes(buf))["a"].flags.writeable


def test_order_follows_header_or_expected_layout() -> None:
    state = {"z": np.zeros(1, np.float32), "a": np.ones(2, np.float32), "m": np.zeros(3, np.int8)}
    payload = encode_state(state)
    assert list(decode_state(payload)) == ["z", "a", "m"]
    expected = tuple(sorted(state_spec(state), key=lambda s: s.name))
    assert list(decode_state(payload, expected=expected)) == ["a", "m", "z"]


def test_state_spec_and_nbytes() -> None:
    state = _sample_state()
    specs = state_spec(state)
    assert [s.name for s in specs] == list(state)
    assert specs[0] == TensorSpec("w", "F32", (4, 3))
    assert specs[2] == TensorSpec("scale", "F64", ())
    assert state_nbytes(state) == sum(s.nbytes for s in specs) == 48 + 24 + 8 + 3 + 0


# --- interop with the reference safetensors implementation -----------------------------------


def test_our_bytes_load_with_safetensors() -> None:
    state = _sample_state()
    loaded = st.load(encode_state(state))
    assert set(loaded) == set(state)
    for name, arr in state.items():
        assert loaded[name].dtype == arr.dtype and loaded[name].shape == arr.shape
        np.testing.assert_array_equal(loaded[name], arr)


def test_safetensors_bytes_decode_with_us() -> None:
    state = _sample_state()
    out = decode_state(st.save(state, metadata={"format": "np"}))
    assert set(out) == set(state)
    for name, arr in state.items():
        assert out[name].dtype == arr.dtype and out[name].shape == arr.shape
        np.testing.assert_array_equal(out[name], arr)


# --- hostile input ---------------------------------------------------------------------------

HOSTILE = {
    "short buffer": (b"\x01\x02\x03", "too short"),
    "header length beyond buffer": (struct.pack("<Q", 1000) + b"{}", "header length 1000"),
    "header length 2**64-1": (b"\xff" * 8 + b"{}", "out of bounds"),
    "non-JSON header": (_frame(b"{not json"), "not valid JSON"),
    "non-UTF-8 header": (_frame(b"\xff\xfe{}"), "not valid JSON"),
    "huge integer": (_frame(b'{"t":{"shape":[' + b"9" * 5000 + b"]}}"), "not valid JSON"),
    "deeply nested": (_frame(b"[" * 100_000), "not valid JSON"),
    "header a list": (_frame([1, 2]), "must be a JSON object"),
    "header a string": (_frame("x"), "must be a JSON object"),
    "entry not an object": (_frame({"t": [1]}), "malformed"),
    "unknown dtype": (_frame({"t": _one("BF16", (2,))}, b"\0" * 4), "dtype 'BF16' not allowed"),
    "dtype a list": (_frame({"t": _one(["F32"])}, b"\0" * 4), "not allowed"),
    "dtype missing": (_frame({"t": {"shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "dtype"),
    "negative dim": (_frame({"t": _one(shape=(-1,))}, b"\0" * 4), "bad shape"),
    "float dim": (_frame({"t": _one(shape=(1.0,))}, b"\0" * 4), "bad shape"),
    "bool dim": (_frame({"t": _one(shape=(True,))}, b"\0" * 4), "bad shape"),
    "shape not a list": (_frame({"t": _one(shape=4)}, b"\0" * 4), "bad shape"),
    "too many dims": (_frame({"t": _one("U8", [1] * 100, (0, 1))}, b"\0"), "bad shape"),
    "dims that wrap int64": (
        _frame({"t": _one("U8", [2**39] * 3, (0, 0))}),
        "0 bytes for shape",
    ),
    "offset past the end": (_frame({"t": _one(offsets=(0, 8))}, b"\0" * 4), "out of bounds"),
    "negative offset": (_frame({"t": _one(offsets=(-4, 0))}, b"\0" * 4), "out of bounds"),
    "reversed offsets": (_frame({"t": _one(offsets=(4, 0))}, b"\0" * 4), "out of bounds"),
    "float offsets": (_frame({"t": _one(offsets=(0.0, 4.0))}, b"\0" * 4), "out of bounds"),
    "three offsets": (_frame({"t": _one(offsets=(0, 4, 8))}, b"\0" * 8), "out of bounds"),
    "overlapping offsets": (
        _frame({"a": _one(offsets=(0, 4)), "b": _one(offsets=(2, 6))}, b"\0" * 8),
        "overlap or leave gaps",
    ),
    "same span twice": (
        _frame({"a": _one(offsets=(0, 4)), "b": _one(offsets=(0, 4))}, b"\0" * 4),
        "overlap or leave gaps",
    ),
    "gap between tensors": (
        _frame({"a": _one(offsets=(0, 4)), "b": _one(offsets=(8, 12))}, b"\0" * 12),
        "overlap or leave gaps",
    ),
    "trailing bytes": (encode_state({"a": np.ones(2, np.float32)}) + b"xx", "tensors cover 8"),
    "byte count not matching shape": (
        _frame({"t": _one(shape=(2,), offsets=(0, 4))}, b"\0" * 4),
        "4 bytes for shape [2]",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_bytes_raise_wire_error(case: str) -> None:
    payload, message = HOSTILE[case]
    with pytest.raises(WireError, match=re.escape(message)):
        decode_state(payload)


def test_payload_over_max_bytes_is_refused_before_parsing() -> None:
    payload = encode_state({"a": np.ones(100, np.float32)})
    decode_state(payload, max_bytes=len(payload))
    with pytest.raises(WireError, match=f"{len(payload)} bytes exceeds the limit of 100"):
        decode_state(payload, max_bytes=100)


def test_header_longer_than_the_header_limit_is_refused() -> None:
    hlen = MAX_HEADER_BYTES + 8
    payload = struct.pack("<Q", hlen) + b" " * hlen
    with pytest.raises(WireError, match="out of bounds"):
        decode_state(payload)


# --- layout and finiteness checks -------------------------------------------------------------


def _layout() -> tuple[TensorSpec, ...]:
    return (TensorSpec("w", "F32", (2, 3)), TensorSpec("b", "F32", (3,)))


@pytest.mark.parametrize(
    ("got", "message"),
    [
        ((TensorSpec("w", "F32", (3, 2)), TensorSpec("b", "F32", (3,))), r"'w': shape \[3, 2\]"),
        ((TensorSpec("w", "F32", (2, 3)), TensorSpec("b", "F16", (3,))), "'b': dtype F16"),
        ((TensorSpec("w", "F32", (2, 3)),), r"missing \['b'\]"),
        ((*_layout(), TensorSpec("extra", "F32", (1,))), r"unexpected \['extra'\]"),
    ],
    ids=["shape", "dtype", "missing", "extra"],
)
def test_check_layout_names_the_tensor(got: tuple[TensorSpec, ...], message: str) -> None:
    check_layout(_layout(), _layout())
    with pytest.raises(UpdateRejected, match=message):
        check_layout(got, _layout())


def test_decode_with_expected_layout_rejects_a_mismatch() -> None:
    payload = encode_state({"w": np.zeros((3, 2), np.float32), "b": np.zeros(3, np.float32)})
    with pytest.raises(UpdateRejected, match="'w'"):
        decode_state(payload, expected=_layout())


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_check_finite_catches_nan_and_inf(bad: float, dtype: type) -> None:
    good = np.zeros(4, dtype=dtype)
    spoiled = good.copy()
    spoiled[2] = bad
    check_finite({"ok": good, "ints": np.arange(3)})
    with pytest.raises(UpdateRejected, match="'spoiled'"):
        check_finite({"ok": good, "spoiled": spoiled})


# --- fuzzing ----------------------------------------------------------------------------------

HOSTILE_VALUES: list[object] = [
    None, True, -1, 0, 2**63, 2**70, 1.5, "F32", "", [], [0], [-1, 4], [[0]], {}, {"a": 1},
    [2**40], [1] * 40, [0, 2**64],
]  # fmt: skip


def _mutate(payload: bytes, rng: random.Random) -> bytes:
    kind = rng.randrange(5)
    data = bytearray(payload)
    hlen = struct.unpack("<Q", payload[:8])[0]
    if kind == 0:  # flip bytes, mostly in the header where they matter
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(8 + hlen) if rng.random() < 0.8 else rng.randrange(len(data))
            data[pos] = rng.randrange(256)
        return bytes(data)
    if kind == 1:  # truncate
        return bytes(data[: rng.randrange(len(data))])
    if kind == 2:  # lie about the header length
        return struct.pack("<Q", max(0, hlen + rng.randint(-20, 20))) + payload[8:]
    if kind == 3:  # splice random bytes in
        pos = rng.randrange(len(data))
        return bytes(data[:pos] + rng.randbytes(rng.randint(1, 16)) + data[pos:])
    header = json.loads(payload[8 : 8 + hlen])  # a well-formed header with a hostile value
    name = rng.choice(list(header))
    header[name][rng.choice(["dtype", "shape", "data_offsets"])] = rng.choice(HOSTILE_VALUES)
    return _frame(header, payload[8 + hlen :])


def test_fuzzed_payloads_only_raise_flotilla_errors() -> None:
    rng = random.Random(20240601)
    payload = encode_state(_sample_state())
    outcomes = {"decoded": 0, "refused": 0}
    for _ in range(300):
        mutated = _mutate(payload, rng)
        try:
            out = decode_state(mutated, max_bytes=1 << 20)
        except FlotillaError:
            outcomes["refused"] += 1
            continue
        outcomes["decoded"] += 1
        for arr in out.values():  # whatever decodes must be a usable array view
            assert arr.nbytes <= len(mutated)
            arr.sum()
    assert outcomes["refused"] > 100
