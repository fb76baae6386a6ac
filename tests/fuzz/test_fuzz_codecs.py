"""Every codec in compression's registry: a whole update decoded against a layout with
the job's codec (``decode_state_with``, what the server's upload check runs) and a
standalone one-tensor payload (``Codec.decode``)."""

from __future__ import annotations

import numpy as np
import pytest

from flotilla.compression import (
    CODEC_NAMES,
    CodecContext,
    decode_state_with,
    encode_state_with,
    make_codec,
    max_payload_bytes,
)
from flotilla.core.errors import UpdateRejected, WireError
from flotilla.core.tensors import state_spec
from tests.fuzz.harness import Target, fuzz
from tests.fuzz.safetensors_inputs import safetensors_inputs

pytestmark = [pytest.mark.fuzz, pytest.mark.xdist_group("fuzz"), pytest.mark.timeout(300)]

#: Small tensors, several blocks or buckets each: cheap inputs that still cover the block
#: and index arithmetic.
_STATE = {
    "w": np.linspace(-2.0, 2.0, 150, dtype=np.float32).reshape(10, 15),
    "b": np.array([0.5, -0.25, 0.0, 3.0, -1.0], dtype=np.float32),
}
LAYOUT = state_spec(_STATE)
#: Parameters that give each codec more than one block, bucket or kept index here.
PARAMS = {
    "int8": {"block_size": 64},
    "int4": {"block_size": 16},
    "qsgd": {"bucket_size": 32},
    "topk": {"fraction": 0.1, "values": "F16"},
    "randk": {"fraction": 0.1, "unbiased": True},
}


def codec_target(name: str) -> tuple[Target, tuple[bytes, ...]]:
    """The harness for one codec and the valid payloads its inputs grow from."""
    codec = make_codec(name, PARAMS.get(name))
    limit = max_payload_bytes(codec, LAYOUT)
    ctx = CodecContext.seeded(0)
    seeds = (
        encode_state_with(codec, _STATE, ctx),
        encode_state_with(codec, {k: -v for k, v in _STATE.items()}, ctx),
        codec.encode(_STATE["w"], ctx),  # type: ignore[attr-defined]
    )

    def decode(data: bytes) -> None:
        """Both decoders on every input; refused only when both refuse."""
        try:
            decode_state_with(data, LAYOUT, limit, codec=codec)
            return
        except (WireError, UpdateRejected):
            pass
        codec.decode(data, max_elements=4096)  # type: ignore[attr-defined]

    return Target(f"codec-{name}", decode, (WireError, UpdateRejected)), seeds


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_codec_payloads_decode_or_raise_our_errors(name: str) -> None:
    target, seeds = codec_target(name)
    fuzz(target, safetensors_inputs(seeds), regressions=seeds)
