"""Whole-model helpers: one safetensors blob for a model delta, and its checked decoding.

Piece ``p`` of tensor ``t`` travels as ``"t::p"``; the codec's name and parameters sit in
``__metadata__``. Every piece's dtype and shape follows from the model's layout, so the
decoder refuses a payload whose header disagrees before it allocates anything.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import numpy as np

from flotilla.compression.codec import (
    Codec,
    CodecContext,
    as_flat_f32,
    codec_metadata,
    piece_views,
)
from flotilla.compression.feedback import ErrorFeedback
from flotilla.compression.registry import codec_from_metadata
from flotilla.core.errors import UpdateRejected, WireError
from flotilla.core.tensors import TensorSpec, encode_state, read_metadata

SEP = "::"
#: Room in ``max_payload_bytes`` for other writers' header formatting (spaces, key order).
HEADER_SLACK_BYTES = 1024
#: The stated header cost in ``theoretical_bytes``: length prefix, metadata and padding ...
HEADER_BASE_BYTES = 160
#: ... plus this much per piece, on top of the piece's full name.
HEADER_PIECE_BYTES = 56


def encode_state_with(
    codec: Codec,
    state: Mapping[str, np.ndarray],
    ctx: CodecContext | None = None,
    feedback: ErrorFeedback | None = None,
) -> bytes:
    """One payload for a whole model delta.

    With ``feedback``, each tensor's residual is added before encoding and replaced by what
    this encoding left out; the residuals are then saved (when the feedback has a directory).
    """
    ctx = ctx or CodecContext()
    pieces: dict[str, np.ndarray] = {}
    for name, value in state.items():
        shape = tuple(np.shape(value))
        flat = as_flat_f32(value, name)
        if feedback is not None:
            flat = feedback.compensate(name, shape, flat)
        try:
            encoded = codec.encode_pieces(flat, ctx)
        except UpdateRejected as exc:
            raise UpdateRejected(f"tensor {name!r}: {exc}") from exc
        if feedback is not None:
            feedback.update(name, shape, flat, codec.decode_pieces(encoded, flat.size))
        for spec in codec.pieces(flat.size):
            pieces[f"{name}{SEP}{spec.name}"] = encoded[spec.name]
    payload = encode_state(pieces, codec_metadata(codec))
    if feedback is not None:
        feedback.save()
    return payload


def decode_state_with(
    payload: bytes | bytearray | memoryview,
    layout: tuple[TensorSpec, ...],
    max_bytes: int,
    *,
    codec: Codec | None = None,
) -> dict[str, np.ndarray]:
    """float32 arrays in ``layout``'s order and shapes; WireError on any malformed payload.

    The codec comes from the payload's metadata; pass ``codec`` to insist on the job's.
    """
    found = codec_from_metadata(read_metadata(payload, max_bytes))
    if codec is not None and (found.name, found.params()) != (codec.name, codec.params()):
        raise WireError(
            f"payload uses codec {found.name!r} {found.params()}, "
            f"the job expects {codec.name!r} {codec.params()}"
        )
    limit = max_payload_bytes(found, layout)
    if len(payload) > limit:
        raise WireError(f"{found.name} payload of {len(payload)} bytes exceeds {limit}")
    views = piece_views(payload, _piece_specs(found, layout), max_bytes)
    out: dict[str, np.ndarray] = {}
    for spec in layout:
        n = math.prod(spec.shape)
        mine = {p.name: views[f"{spec.name}{SEP}{p.name}"] for p in found.pieces(n)}
        out[spec.name] = found.decode_pieces(mine, n).reshape(spec.shape)
    return out


def _piece_specs(codec: Codec, layout: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
    return tuple(
        TensorSpec(f"{spec.name}{SEP}{p.name}", p.dtype, p.shape)
        for spec in layout
        for p in codec.pieces(math.prod(spec.shape))
    )


def max_payload_bytes(codec: Codec, layout: tuple[TensorSpec, ...]) -> int:
    """An upper bound on the payload for ``layout``: admit or refuse before allocating."""
    specs = _piece_specs(codec, layout)
    data = sum(s.nbytes for s in specs)
    digits = len(str(data))
    meta = json.dumps({"__metadata__": codec_metadata(codec)}, separators=(",", ":"))
    header = len(meta) + 2
    for s in specs:
        entry = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [0, 0]}
        header += len(json.dumps({s.name: entry}, separators=(",", ":"))) + 2 * digits
    return 8 + header + 7 + HEADER_SLACK_BYTES + data


def theoretical_bytes(codec: Codec, layout: tuple[TensorSpec, ...]) -> int:
    """The payload size by formula: the pieces' data bits, plus the stated header cost
    (``HEADER_BASE_BYTES`` + per piece ``HEADER_PIECE_BYTES`` + its name)."""
    specs = _piece_specs(codec, layout)
    header = HEADER_BASE_BYTES + sum(HEADER_PIECE_BYTES + len(s.name) for s in specs)
    return header + sum(s.nbytes for s in specs)
