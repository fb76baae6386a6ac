"""Model states and their safe wire format.

A model state is an ordered mapping of tensor name -> numpy array. On the wire it is
safetensors bytes: a length-prefixed JSON header then raw little-endian data, readable from
Rust, Swift or JS clients. Decoding here checks every size and offset *before* touching
data and returns zero-copy views, so hostile bytes can neither allocate nor execute.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from flotilla.core.errors import UpdateRejected, WireError

ModelState = dict[str, np.ndarray]

#: safetensors dtype names we accept, and their numpy equivalents.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NAMES = {dt: name for name, dt in DTYPES.items()}
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_TENSORS = 100_000
#: Most dimensions a tensor may have (numpy 1.x supports 32).
MAX_DIMS = 32
#: Most entries in the safetensors ``__metadata__`` string map.
MAX_METADATA_ENTRIES = 1024


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, dtype and shape of one tensor: what a decoder expects before allocating."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        # Python ints: a hostile shape must not wrap around int64 to match a small span.
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


class FlatState(dict[str, np.ndarray]):
    """A model state whose float32 tensors are views of one 1-D buffer, back to back in
    layout order, so a pass over the whole model is one array operation (aggregators fold
    and check such updates in one go). Its keys are fixed: assigning one raises."""

    __slots__ = ("flat", "layout")

    def __init__(self, flat: np.ndarray, layout: Sequence[TensorSpec]) -> None:
        if flat.dtype != np.float32 or flat.ndim != 1 or not flat.flags.c_contiguous:
            raise ValueError("a FlatState needs a contiguous 1-D float32 buffer")
        sizes = [math.prod(s.shape) for s in layout]
        if sum(sizes) != flat.size:
            raise ValueError(f"layout holds {sum(sizes)} elements, the buffer {flat.size}")
        start = 0
        views = {}
        for spec, size in zip(layout, sizes, strict=True):
            views[spec.name] = flat[start : start + size].reshape(spec.shape)
            start += size
        super().__init__(views)
        self.flat = flat
        self.layout = tuple(layout)

    def __reduce__(self) -> tuple[type[FlatState], tuple[np.ndarray, tuple[TensorSpec, ...]]]:
        return FlatState, (self.flat, self.layout)

    def __setitem__(self, key: str, value: np.ndarray) -> None:
        raise TypeError("a FlatState's tensors are views of one buffer; write into them")

    def _fixed(self, *args: object, **kwargs: object) -> None:
        raise TypeError("a FlatState's keys are fixed")

    __delitem__ = update = pop = popitem = clear = setdefault = _fixed  # type: ignore[assignment]


def state_spec(state: Mapping[str, np.ndarray]) -> tuple[TensorSpec, ...]:
    """The layout of a state, in its own order."""
    return tuple(TensorSpec(k, _dtype_name(v.dtype), tuple(v.shape)) for k, v in state.items())


def state_nbytes(state: Mapping[str, np.ndarray]) -> int:
    return sum(int(v.nbytes) for v in state.values())


def _dtype_name(dtype: np.dtype) -> str:
    try:
        return _NAMES[np.dtype(dtype)]
    except KeyError as exc:
        raise WireError(f"dtype {dtype} cannot travel on the wire") from exc


def encode_state(
    state: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> bytes:
    """safetensors bytes of a state; tensor order follows the mapping.

    ``metadata`` becomes the header's ``__metadata__`` string map (codecs record themselves
    there).
    """
    # One join: the tensors are copied once, straight into the result.
    return b"".join(encode_state_parts(state, metadata))


def state_sha256(state: Mapping[str, np.ndarray]) -> str:
    """SHA-256 of ``encode_state(state)``, without joining it: a checkpoint's blob id."""
    digest = hashlib.sha256()
    for part in encode_state_parts(state):
        digest.update(part)
    return digest.hexdigest()


def encode_state_parts(
    state: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> list[bytes | memoryview]:
    """The safetensors bytes of a state as consecutive pieces: the header, then each
    tensor's memory, uncopied. A writer that streams them (a checkpoint to disk) never
    needs a model-sized buffer."""
    header: dict[str, object] = {}
    if metadata is not None:
        header["__metadata__"] = _checked_metadata(metadata, WireError)
    offset = 0
    arrays = []
    for name, value in state.items():
        arr = np.asarray(value, order="C")  # ascontiguousarray would turn 0-d into (1,)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        dtype = _dtype_name(arr.dtype)
        header[name] = {
            "dtype": dtype,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays.append(arr)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data section for zero-copy readers
    parts: list[bytes | memoryview] = [struct.pack("<Q", len(raw)), raw]
    parts += [arr.reshape(-1).view(np.uint8).data for arr in arrays]
    return parts


def _checked_metadata(metadata: object, error: type[Exception]) -> dict[str, str]:
    """The safetensors rule: ``__metadata__`` is a flat map of strings to strings."""
    if not isinstance(metadata, Mapping) or len(metadata) > MAX_METADATA_ENTRIES:
        raise error(
            f"safetensors __metadata__ must be a map of at most {MAX_METADATA_ENTRIES} strings"
        )
    out: dict[str, str] = {}
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise error(f"safetensors __metadata__ entry {key!r} is not a string pair")
        out[key] = value
    return out


def read_metadata(buf: bytes | bytearray | memoryview, max_bytes: int) -> dict[str, str]:
    """The header's ``__metadata__`` string map (empty when absent), bound-checked."""
    header = _parse_header(memoryview(buf), max_bytes)
    return _checked_metadata(header.get("__metadata__", {}), WireError)


def _parse_header(view: memoryview, max_bytes: int) -> dict[str, object]:
    if len(view) > max_bytes:
        raise WireError(f"payload of {len(view)} bytes exceeds the limit of {max_bytes}")
    if len(view) < 8:
        raise WireError("payload too short for a safetensors header")
    (hlen,) = struct.unpack("<Q", view[:8])
    if hlen > min(MAX_HEADER_BYTES, len(view) - 8):
        raise WireError(f"safetensors header length {hlen} is out of bounds")
    try:
        header = json.loads(bytes(view[8 : 8 + hlen]))
    except (ValueError, RecursionError) as exc:  # bad UTF-8/JSON, huge ints, deep nesting
        raise WireError(f"safetensors header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise WireError("safetensors header must be a JSON object")
    return header


def read_header(
    buf: bytes | bytearray | memoryview, max_bytes: int
) -> tuple[tuple[TensorSpec, ...], list[tuple[int, int]], int]:
    """Parse and bound-check a safetensors header: specs, data offsets, data start."""
    view = memoryview(buf)
    header = _parse_header(view, max_bytes)
    (hlen,) = struct.unpack("<Q", view[:8])
    header.pop("__metadata__", None)
    if len(header) > MAX_TENSORS:
        raise WireError(f"too many tensors ({len(header)})")
    data_start = 8 + hlen
    data_len = len(view) - data_start
    specs: list[TensorSpec] = []
    spans: list[tuple[int, int]] = []
    for name, entry in header.items():
        spec, span = _entry(name, entry, data_len)
        specs.append(spec)
        spans.append(span)
    covered = sorted(spans)
    pos = 0
    for begin, end in covered:
        if begin != pos:
            raise WireError("safetensors data offsets overlap or leave gaps")
        pos = end
    if pos != data_len:
        raise WireError(f"safetensors data is {data_len} bytes but tensors cover {pos}")
    return tuple(specs), spans, data_start


def _entry(name: object, entry: object, data_len: int) -> tuple[TensorSpec, tuple[int, int]]:
    if not isinstance(name, str) or not isinstance(entry, dict):
        raise WireError("malformed safetensors header entry")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise WireError(f"tensor {name!r}: dtype {dtype!r} not allowed")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape)
    ):
        raise WireError(f"tensor {name!r}: bad shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_len
    ):
        raise WireError(f"tensor {name!r}: data offsets {offsets!r} out of bounds")
    spec = TensorSpec(name, dtype, tuple(shape))
    if offsets[1] - offsets[0] != spec.nbytes:
        raise WireError(f"tensor {name!r}: {offsets[1] - offsets[0]} bytes for shape {shape}")
    return spec, (offsets[0], offsets[1])


def decode_state(
    buf: bytes | bytearray | memoryview,
    expected: tuple[TensorSpec, ...] | None = None,
    max_bytes: int = 2**34,
) -> ModelState:
    """Zero-copy arrays from safetensors bytes, checked against ``expected`` when given.

    The arrays are read-only views into ``buf``. Order follows ``expected`` if given.
    """
    specs, spans, start = read_header(buf, max_bytes)
    if expected is not None:
        check_layout(specs, expected)
    view = memoryview(buf).toreadonly()
    out: ModelState = {}
    by_name = {s.name: (s, span) for s, span in zip(specs, spans, strict=True)}
    order = [s.name for s in expected] if expected is not None else [s.name for s in specs]
    for name in order:
        spec, (begin, end) = by_name[name]
        arr = np.frombuffer(view[start + begin : start + end], dtype=DTYPES[spec.dtype])
        out[name] = arr.reshape(spec.shape)
    return out


def check_layout(got: tuple[TensorSpec, ...], expected: tuple[TensorSpec, ...]) -> None:
    """Refuse a state whose names, dtypes or shapes differ from the model's."""
    want = {s.name: s for s in expected}
    have = {s.name: s for s in got}
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    if missing or extra:
        raise UpdateRejected(f"tensor names differ: missing {missing}, unexpected {extra}")
    for name, spec in want.items():
        other = have[name]
        if other.dtype != spec.dtype:
            raise UpdateRejected(f"tensor {name!r}: dtype {other.dtype}, expected {spec.dtype}")
        if other.shape != spec.shape:
            raise UpdateRejected(
                f"tensor {name!r}: shape {list(other.shape)}, expected {list(spec.shape)}"
            )


def check_finite(state: Mapping[str, np.ndarray]) -> None:
    """Refuse NaN or Inf anywhere in a floating-point state."""
    for name, arr in state.items():
        if not all_finite(arr):
            raise UpdateRejected(f"tensor {name!r} contains NaN or Inf")


def all_finite(arr: np.ndarray) -> bool:
    """True when no element is NaN or Inf, without a mask the size of the tensor.

    NaN or Inf anywhere makes ``x . x`` non-finite, so a finite dot product clears the
    tensor in one read. Only a result that overflowed is checked block by block.
    """
    if arr.dtype.kind != "f":
        return True
    flat = np.asarray(arr).reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        if flat.dtype in (np.float32, np.float64):
            quick = np.dot(flat, flat)
        else:
            quick = flat.sum(dtype=np.float32)
        if np.isfinite(quick):
            return True
    step = 1 << 18
    return all(bool(np.isfinite(flat[i : i + step]).all()) for i in range(0, flat.size, step))
