"""The broadcast model as a device decodes it, shared by the agent, p2p rounds and the
simulator (which must see exactly what a real device sees)."""

from __future__ import annotations

from flotilla.compression.registry import make_codec
from flotilla.compression.state import decode_state_with
from flotilla.core.errors import WireError
from flotilla.core.round_config import RoundConfig
from flotilla.core.tensors import ModelState, decode_state


def decode_model(payload: bytes | memoryview, config: RoundConfig) -> ModelState:
    """The broadcast model: plain safetensors, or the job's downlink codec payload."""
    spec = config.compression
    if spec.downlink == "none" or spec.downlink_delta:  # delta broadcasts rebuild whole models
        return decode_state(payload)
    if config.layout is None:
        raise WireError("a compressed broadcast came without the model's layout")
    codec = make_codec(spec.downlink, spec.downlink_params)
    return decode_state_with(payload, config.layout, len(payload), codec=codec)
