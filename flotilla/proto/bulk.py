"""The two bulk messages, framed and read by hand to spare model-sized copies.

``BlobChunk`` (model downloads) and ``UpdateChunk`` (update uploads) carry 1 MiB of
payload each, and a 10M-parameter round moves thousands of them. Built the usual way, each
payload is copied into a protobuf message and again into its serialized form; parsed the
usual way, copied out of the wire bytes once more. Here a chunk is framed straight from the
payload (one copy) and read as a view into the bytes gRPC received (no copy).

The bytes are standard protobuf either way: the concatenation of two serialized messages is
their merge, so the small fields are serialized by protobuf and the payload field appended
by hand, and any client that uses the generated classes reads and writes the same messages.
"""

from __future__ import annotations

from dataclasses import dataclass

from flotilla.core.errors import WireError
from flotilla.proto import flotilla_pb2 as pb

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
_BLOB_DATA = 1  # BlobChunk.data
_UPDATE_HEADER, _UPDATE_DATA = 1, 2  # UpdateChunk.header, UpdateChunk.data


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(view):
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            break
    raise WireError("malformed protobuf message: bad varint")


def frame_bytes_field(
    field: int, data: bytes | bytearray | memoryview, before: bytes = b""
) -> bytes:
    """``before`` then ``field`` as a length-delimited field holding ``data``: one copy."""
    return b"".join((before, _varint(field << 3 | _LENGTH), _varint(len(data)), data))


@dataclass(frozen=True, slots=True)
class _Span:
    field: int
    start: int  # first byte of the field's tag
    value: int  # first byte of its value
    end: int


def _fields(view: memoryview) -> list[_Span]:
    """The top-level fields of a serialized message, in wire order."""
    spans = []
    pos = 0
    while pos < len(view):
        start = pos
        key, pos = _read_varint(view, pos)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise WireError("malformed protobuf message: field number 0")
        if wire == _VARINT:
            _, end = _read_varint(view, pos)
        elif wire == _LENGTH:
            length, pos = _read_varint(view, pos)
            end = pos + length
        elif wire == _FIXED64:
            end = pos + 8
        elif wire == _FIXED32:
            end = pos + 4
        else:
            raise WireError(f"malformed protobuf message: wire type {wire}")
        if end > len(view):
            raise WireError("malformed protobuf message: field runs past the end")
        spans.append(_Span(field, start, pos, end))
        pos = end
    return spans


def _bytes_value(raw: bytes, view: memoryview, span: _Span) -> memoryview:
    """The value of a length-delimited field, as a view into ``raw``."""
    if raw[span.start] & 7 != _LENGTH:
        raise WireError(f"malformed protobuf message: field {span.field} is not bytes")
    return view[span.value : span.end]


def split_bytes_field(raw: bytes, payload_field: int) -> tuple[memoryview | None, bytes]:
    """(view of the payload field's last occurrence, the message without it).

    The rest holds only small fields and is parsed by protobuf; the payload, a view into
    ``raw``, is never copied.
    """
    view = memoryview(raw)
    hits = [s for s in _fields(view) if s.field == payload_field]
    if not hits:
        return None, raw
    last = hits[-1]
    rest = bytes(view[: last.start]) + bytes(view[last.end :])
    return _bytes_value(raw, view, last), rest


# --- BlobChunk -----------------------------------------------------------------------------


def blob_chunk(
    data: bytes | bytearray | memoryview, offset: int, total_size: int = 0, sha256: str = ""
) -> bytes:
    """A serialized ``BlobChunk``."""
    small = pb.BlobChunk(offset=offset, total_size=total_size, sha256=sha256)
    return frame_bytes_field(_BLOB_DATA, data, before=small.SerializeToString())


@dataclass(frozen=True, slots=True)
class BlobPiece:
    """A received ``BlobChunk``; ``data`` is a view into the message's bytes."""

    data: memoryview
    offset: int
    total_size: int
    sha256: str


def read_blob_chunk(raw: bytes) -> BlobPiece:
    data, rest = split_bytes_field(raw, _BLOB_DATA)
    try:
        small = pb.BlobChunk.FromString(rest)
    except Exception as exc:  # protobuf's DecodeError
        raise WireError(f"malformed BlobChunk: {exc}") from None
    return BlobPiece(
        data if data is not None else memoryview(b""), small.offset, small.total_size, small.sha256
    )


# --- UpdateChunk ---------------------------------------------------------------------------


def update_data(data: bytes | bytearray | memoryview) -> bytes:
    """A serialized ``UpdateChunk`` carrying payload bytes."""
    return frame_bytes_field(_UPDATE_DATA, data)


def update_header(header: pb.UpdateHeader) -> bytes:
    """A serialized ``UpdateChunk`` carrying the header."""
    return pb.UpdateChunk(header=header).SerializeToString()


@dataclass(frozen=True, slots=True)
class UpdatePart:
    """A received ``UpdateChunk``: exactly one of ``header`` or ``data`` (a view), or
    neither for an empty message."""

    header: pb.UpdateHeader | None = None
    data: memoryview | None = None


def read_update_chunk(raw: bytes) -> UpdatePart:
    # ``part`` is a oneof: the member that comes last on the wire is the one set.
    view = memoryview(raw)
    parts = [s for s in _fields(view) if s.field in (_UPDATE_HEADER, _UPDATE_DATA)]
    if parts and parts[-1].field == _UPDATE_DATA:
        return UpdatePart(data=_bytes_value(raw, view, parts[-1]))
    try:
        msg = pb.UpdateChunk.FromString(raw)
    except Exception as exc:  # protobuf's DecodeError
        raise WireError(f"malformed UpdateChunk: {exc}") from None
    return UpdatePart(header=msg.header if msg.HasField("header") else None)


__all__ = [
    "BlobPiece",
    "UpdatePart",
    "blob_chunk",
    "frame_bytes_field",
    "read_blob_chunk",
    "read_update_chunk",
    "split_bytes_field",
    "update_data",
    "update_header",
]
