"""Flotilla's codecs as hivemind ``CompressionBase`` implementations.

hivemind 1.1.12's own 8-bit quantizers (``Uniform8BitQuantization``,
``Quantile8BitQuantization``) cannot decode under NumPy 2: their ``extract`` calls
``int()`` on a one-element array (``TypeError: only 0-dimensional arrays can be converted
to Python scalars``). Flotilla's blockwise absmax int8 (:class:`~flotilla.compression.Int8Codec`)
travels instead under hivemind's ``UNIFORM_8BIT`` wire type. Receivers decode by wire type
through hivemind's table of deserializers, so :func:`install_codecs` puts flotilla's
decoder into that table; every flotilla peer calls it before it averages. A plain-hivemind
peer joining an int8 run must do the same (docs/p2p.md); ``none`` and ``fp16`` need nothing.

The payload is ``b"FLQ8"``, the block size (uint32, little-endian), one float32 scale per
block, then one int8 per value. It is checked like any flotilla payload: a malformed one
raises ``WireError``, never yields garbage.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import torch
from hivemind.compression import CompressionBase, CompressionInfo, Float16Compression, NoCompression
from hivemind.proto import runtime_pb2

from flotilla.compression.quantize import Int8Codec, absmax_dequantize, absmax_quantize
from flotilla.core.errors import SpecError, WireError

MAGIC = b"FLQ8"
_HEADER = struct.Struct("<4sI")
#: ``record.compression`` names: what a run's averaging rounds send.
COMPRESSION_NAMES = ("none", "fp16", "int8")


class FlotillaInt8(CompressionBase):  # type: ignore[misc]
    """Blockwise absmax int8 (error per value <= block absmax / 254) for hivemind."""

    compression_type = runtime_pb2.UNIFORM_8BIT

    def __init__(self, block_size: int = Int8Codec.block_size) -> None:
        self.block_size = Int8Codec(block_size).block_size

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> runtime_pb2.Tensor:
        if not torch.is_floating_point(tensor):
            raise ValueError(f"int8 compression needs a floating-point tensor, got {tensor.dtype}")
        flat = tensor.detach().to("cpu", torch.float32).reshape(-1).numpy()
        if not np.isfinite(flat).all():
            raise ValueError("int8 compression refuses a tensor with NaN or Inf")
        scale, q = absmax_quantize(flat, self.block_size, Int8Codec.levels)
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=b"".join((_HEADER.pack(MAGIC, self.block_size), scale.tobytes(), q.tobytes())),
            size=tensor.shape,
            dtype="float32",
            requires_grad=tensor.requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buf = serialized_tensor.buffer
        shape = tuple(int(s) for s in serialized_tensor.size)
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if len(buf) < _HEADER.size:
            raise WireError("int8 tensor: payload shorter than its header")
        magic, block = _HEADER.unpack_from(buf)
        if magic != MAGIC or block < 1:
            raise WireError("int8 tensor: not a flotilla int8 payload (bad magic or block size)")
        blocks = -(-n // block)
        if len(buf) != _HEADER.size + 4 * blocks + n:
            raise WireError(
                f"int8 tensor: {len(buf)} bytes do not hold {n} values in blocks of {block}"
            )
        scale = np.frombuffer(buf, np.float32, blocks, _HEADER.size)
        q = np.frombuffer(buf, np.int8, n, _HEADER.size + 4 * blocks)
        if n and int(q.min()) < -Int8Codec.levels:
            raise WireError("int8 tensor: a value of -128 is never encoded")
        values = absmax_dequantize(q, scale, block, Int8Codec.levels)
        out = torch.from_numpy(values).reshape(shape)
        return out.requires_grad_(serialized_tensor.requires_grad)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return (8 + 32 / self.block_size) / torch.finfo(info.descriptor.dtype).bits


def install_codecs() -> None:
    """Make this process decode flotilla's int8 payloads (hivemind decodes by wire type).

    Idempotent. hivemind keeps its deserializers in a module table and offers no hook, so
    the entry for ``UNIFORM_8BIT`` is replaced; the replaced decoder fails under NumPy 2.
    """
    from hivemind.compression import serialization

    table: dict[str, Any] = serialization._BASE_COMPRESSION_TYPES
    if not isinstance(table.get("UNIFORM_8BIT"), FlotillaInt8):
        table["UNIFORM_8BIT"] = FlotillaInt8()


def hivemind_compression(name: str) -> CompressionBase:
    """The hivemind compression a run record names (and installs its decoder)."""
    if name == "none":
        return NoCompression()
    if name == "fp16":
        return Float16Compression()
    if name == "int8":
        install_codecs()
        return FlotillaInt8()
    raise SpecError(f"compression {name!r} is not one of {', '.join(COMPRESSION_NAMES)}")
