"""Update codecs: how a model delta shrinks before it travels, torch-free (numpy only).

- ``codec``: the :class:`Codec` protocol, :class:`CodecContext` (randomness), the
  per-tensor payload envelope.
- ``floats``: ``none``, ``fp16`` (saturating), ``bf16`` (round to nearest even).
- ``quantize``: blockwise absmax ``int8`` and ``int4``; stochastic, unbiased ``qsgd``.
- ``sparse``: ``topk`` and ``randk`` (indices regenerated from a seed).
- ``registry``: :data:`CODEC_NAMES`, :func:`make_codec`.
- ``state``: whole-model payloads, :func:`encode_state_with`, :func:`decode_state_with`,
  and their size bounds.
- ``delta``: :func:`apply_delta`, the one arithmetic of a downlink delta broadcast.
- ``feedback``: :class:`ErrorFeedback`, per-job residuals saved in the agent's state dir.
- ``pipeline``: :class:`UpdatePipeline` (update momentum, codec, error feedback), the one
  device-side pipeline of the agent and of simulated devices, over pluggable per-client
  state stores (:class:`MemoryStates`, :class:`FileStates`).
- ``broadcast``: :func:`decode_model`, the broadcast model as a device decodes it.

Payloads are safetensors bytes (never pickle); see docs/compression.md.
"""

from flotilla.compression.broadcast import decode_model
from flotilla.compression.codec import Codec, CodecContext, Pieces
from flotilla.compression.delta import apply_average, apply_delta
from flotilla.compression.feedback import ErrorFeedback
from flotilla.compression.floats import Bf16Codec, Fp16Codec, NoneCodec
from flotilla.compression.pipeline import (
    FileStates,
    MemoryStates,
    StateStore,
    UpdatePipeline,
)
from flotilla.compression.quantize import Int4Codec, Int8Codec, QsgdCodec
from flotilla.compression.registry import CODEC_NAMES, codec_from_metadata, make_codec
from flotilla.compression.sparse import RandKCodec, TopKCodec
from flotilla.compression.state import (
    decode_state_with,
    encode_state_with,
    max_payload_bytes,
    theoretical_bytes,
)

__all__ = [
    "CODEC_NAMES",
    "Bf16Codec",
    "Codec",
    "CodecContext",
    "ErrorFeedback",
    "FileStates",
    "Fp16Codec",
    "Int4Codec",
    "Int8Codec",
    "MemoryStates",
    "NoneCodec",
    "Pieces",
    "QsgdCodec",
    "RandKCodec",
    "StateStore",
    "TopKCodec",
    "UpdatePipeline",
    "apply_average",
    "apply_delta",
    "codec_from_metadata",
    "decode_model",
    "decode_state_with",
    "encode_state_with",
    "make_codec",
    "max_payload_bytes",
    "theoretical_bytes",
]
