"""The lite device's uplink codecs: the server decodes what it writes with its own decoder
(``decode_update``), the bytes equal ``flotilla.compression``'s, error feedback keeps the
same residuals as the agent's pipeline, and what it cannot write is refused by name."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from flotilla.compression import (
    CodecContext,
    MemoryStates,
    UpdatePipeline,
    encode_state_with,
    make_codec,
)
from flotilla.core.errors import SpecError, UpdateRejected, WireError
from flotilla.core.tensors import ModelState, encode_state, state_spec
from flotilla.mobile.lite import LiteCodec, supported_codecs
from flotilla.mobile.lite.codecs import decode_payload, encode_update
from flotilla.server.federation.uploads import decode_update


def delta(seed: int = 0) -> ModelState:
    rng = np.random.default_rng(seed)
    return {
        "net.0.weight": rng.normal(0, 0.05, (300, 7)).astype(np.float32),
        "net.0.bias": (rng.normal(size=5) * 1e-42).astype(np.float32),  # subnormal scales
        "zeros": np.zeros(3, np.float32),
        "big": np.array([7e4, -1e5, 3.0], np.float32),  # fp16 saturates
    }


LOSSY: list[tuple[str, dict[str, Any]]] = [
    ("fp16", {}), ("bf16", {}), ("int8", {}), ("int8", {"block_size": 64}),
]  # fmt: skip


@pytest.mark.parametrize(("name", "params"), LOSSY)
def test_payload_is_the_servers_byte_for_byte(name: str, params: dict[str, Any]) -> None:
    state = delta()
    mine, _ = encode_update(LiteCodec.make(name, params), state)
    assert mine == encode_state_with(make_codec(name, params), state, CodecContext.seeded(0))
    server = decode_update(memoryview(mine), state_spec(state), make_codec(name, params), 1 << 24)
    back = decode_payload(mine, LiteCodec.make(name, params), state_spec(state))
    for key, value in state.items():
        assert np.array_equal(server[key], back[key])
        if key != "big":  # within every lossy codec's bound (int8: absmax / 254)
            assert np.abs(server[key] - value).max() <= np.abs(value).max() / 100 + 1e-30


def test_plain_update_is_safetensors_the_server_reads() -> None:
    state = delta()
    payload, residuals = encode_update(LiteCodec.make("none"), state)
    assert payload == encode_state(state) and residuals is None
    got = decode_update(memoryview(payload), state_spec(state), make_codec("none"), 1 << 24)
    assert all(np.array_equal(got[k], v) for k, v in state.items())


def test_error_feedback_keeps_the_agents_residuals() -> None:
    """Three rounds through the agent's pipeline and the lite encoder: same bytes each round."""
    residuals = MemoryStates[str]()
    pipeline = UpdatePipeline(make_codec("int8"), residuals=residuals)
    lite = LiteCodec.make("int8")
    held: ModelState = {}
    for round_no in range(3):
        state = delta(round_no)
        theirs = pipeline("job", state)
        mine, kept = encode_update(lite, state, held)
        assert kept is not None
        held = kept
        assert mine == theirs, f"round {round_no}"
    agent_held = residuals.get("job")
    assert agent_held is not None
    assert all(np.array_equal(agent_held[k], held[k]) for k in held)


def test_what_it_cannot_write_is_refused_by_name() -> None:
    assert supported_codecs() == ("none", "fp16", "bf16", "int8")
    for name in ("topk", "qsgd", "int4", "randk"):
        with pytest.raises(SpecError, match=f"cannot encode codec '{name}'.*int8"):
            LiteCodec.make(name)
    with pytest.raises(SpecError, match="unknown parameter 'fraction'"):
        LiteCodec.make("int8", {"fraction": 0.1})
    with pytest.raises(SpecError, match="block_size"):
        LiteCodec.make("int8", {"block_size": 0})
    bad = delta()
    bad["zeros"][1] = np.nan
    with pytest.raises(UpdateRejected, match="'zeros'"):
        encode_update(LiteCodec.make("int8"), bad)


def test_a_broadcast_that_is_not_the_jobs_codec_is_refused() -> None:
    state = delta()
    layout = state_spec(state)
    payload, _ = encode_update(LiteCodec.make("int8"), state)
    with pytest.raises(WireError, match="names codec"):
        decode_payload(payload, LiteCodec.make("fp16"), layout)
    with pytest.raises(WireError, match="names codec"):
        decode_payload(payload, LiteCodec.make("int8", {"block_size": 128}), layout)
    with pytest.raises(WireError, match="pieces"):
        decode_payload(payload, LiteCodec.make("int8"), layout[:2])
    # A hostile header: right codec, a scale that is NaN.
    pieces = {f"{s.name}::scale": np.full(-(-int(np.prod(s.shape)) // 256), np.nan, np.float32)
              for s in layout}  # fmt: skip
    forged: dict[str, np.ndarray] = {}
    for s in layout:
        forged[f"{s.name}::scale"] = pieces[f"{s.name}::scale"]
        forged[f"{s.name}::q"] = np.zeros(int(np.prod(s.shape)), np.int8)
    meta = {
        "format": "flotilla.compression/1",
        "codec": "int8",
        "params": json.dumps({"block_size": 256}),
    }  # fmt: skip (params parsed, not compared)
    with pytest.raises(WireError, match="scale"):
        decode_payload(encode_state(forged, meta), LiteCodec.make("int8"), layout)
