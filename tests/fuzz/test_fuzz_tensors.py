"""safetensors payloads decoded into a model's layout, as the server decodes a plain
update (``decode_state`` with the layout) and reads a payload's metadata."""

from __future__ import annotations

import numpy as np
import pytest

from flotilla.core.errors import UpdateRejected, WireError
from flotilla.core.tensors import decode_state, encode_state, read_metadata, state_spec
from tests.fuzz.harness import Target, fuzz
from tests.fuzz.safetensors_inputs import safetensors_inputs

pytestmark = [pytest.mark.fuzz, pytest.mark.xdist_group("fuzz"), pytest.mark.timeout(300)]

_STATE = {
    "w": np.arange(12, dtype=np.float32).reshape(4, 3),
    "b": np.ones(3, dtype=np.float32),
    "steps": np.array(7, dtype=np.int64),
}
LAYOUT = state_spec(_STATE)
#: A plain update's size bound, as the server sets it: the model plus header room.
LIMIT = 4096
SEEDS = (
    encode_state(_STATE),
    encode_state(_STATE, {"note": "x"}),
    encode_state({"w": _STATE["w"]}),
)


def decode_update(data: bytes) -> None:
    read_metadata(data, LIMIT)
    decode_state(data, expected=LAYOUT, max_bytes=LIMIT)
    decode_state(data, max_bytes=LIMIT)  # no layout: a model download's own header


TARGET = Target("tensors", decode_update, (WireError, UpdateRejected))


def test_safetensors_payloads_decode_or_raise_our_errors() -> None:
    fuzz(TARGET, safetensors_inputs(SEEDS), regressions=SEEDS)
