"""The hand-framed bulk messages are standard protobuf, read without copying the payload."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from flotilla.core.errors import WireError
from flotilla.proto import bulk, handlers
from flotilla.proto import flotilla_pb2 as pb

SIZES = [0, 1, 127, 128, 16_383, 16_384, 1024 * 1024 + 3]


@pytest.mark.parametrize("size", SIZES)
def test_framed_blob_chunks_are_what_protobuf_reads(size: int) -> None:
    data = os.urandom(size)
    raw = bulk.blob_chunk(data, offset=2**40 + 5, total_size=size * 3, sha256="ab" * 32)
    msg = pb.BlobChunk.FromString(raw)
    assert (msg.data, msg.offset, msg.total_size, msg.sha256) == (
        data,
        2**40 + 5,
        size * 3,
        "ab" * 32,
    )


@pytest.mark.parametrize("size", SIZES)
def test_protobuf_blob_chunks_read_as_views_into_the_wire_bytes(size: int) -> None:
    data = os.urandom(size)
    raw = pb.BlobChunk(data=data, offset=7, total_size=9, sha256="cd" * 32).SerializeToString()
    piece = bulk.read_blob_chunk(raw)
    assert bytes(piece.data) == data
    assert (piece.offset, piece.total_size, piece.sha256) == (7, 9, "cd" * 32)
    if size:
        assert piece.data.obj is raw  # a view, not a copy


def test_a_blob_chunk_without_data_reads_as_empty() -> None:
    piece = bulk.read_blob_chunk(pb.BlobChunk(offset=3).SerializeToString())
    assert bytes(piece.data) == b"" and piece.offset == 3


@pytest.mark.parametrize("size", SIZES)
def test_update_chunks_round_trip_both_ways(size: int) -> None:
    data = os.urandom(size)
    assert pb.UpdateChunk.FromString(bulk.update_data(data)).data == data
    part = bulk.read_update_chunk(pb.UpdateChunk(data=data).SerializeToString())
    assert part.header is None and part.data is not None and bytes(part.data) == data

    header = pb.UpdateHeader(job_id="j", round=4, payload_size=size, metrics={"loss": 0.5})
    assert pb.UpdateChunk.FromString(bulk.update_header(header)).header == header
    part = bulk.read_update_chunk(pb.UpdateChunk(header=header).SerializeToString())
    assert part.data is None and part.header == header


def test_the_oneof_member_last_on_the_wire_wins() -> None:
    header = pb.UpdateHeader(job_id="j")
    head, data = bulk.update_header(header), bulk.update_data(b"xyz")
    assert bytes(bulk.read_update_chunk(head + data).data or b"") == b"xyz"
    assert bulk.read_update_chunk(data + head).header == header
    assert bulk.read_update_chunk(b"") == bulk.UpdatePart()


def test_unknown_fields_are_skipped() -> None:
    # field 9 as varint, fixed64 and fixed32, then the payload
    extra = bytes([9 << 3 | 0, 0x96, 0x01, 9 << 3 | 1, *range(8), 9 << 3 | 5, *range(4)])
    assert bytes(bulk.read_update_chunk(extra + bulk.update_data(b"ok")).data or b"") == b"ok"
    assert bytes(bulk.read_blob_chunk(extra + bulk.blob_chunk(b"ok", 1)).data) == b"ok"


@pytest.mark.parametrize(
    "raw",
    [
        bytes([2 << 3 | 2, 10, 1, 2]),  # length past the end
        bytes([2 << 3 | 2, 0x80]),  # truncated varint
        bytes([2 << 3 | 3]),  # group wire type
        bytes([0 << 3 | 2, 0]),  # field number 0
        bytes([2 << 3 | 0, 1]),  # the payload field as a varint
    ],
)
def test_malformed_messages_are_wire_errors(raw: bytes) -> None:
    with pytest.raises(WireError):
        bulk.read_update_chunk(raw)


def test_register_refuses_overrides_for_methods_the_service_lacks() -> None:
    async def attempt() -> None:
        server = grpc.aio.server()
        handlers.register(server, "Agent", object(), {"NoSuchMethod": handlers.PRESERIALIZED})

    with pytest.raises(ValueError, match="NoSuchMethod"):
        asyncio.run(attempt())
