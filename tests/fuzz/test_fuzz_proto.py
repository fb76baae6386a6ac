"""The gRPC edge's request bytes: the hand-framed bulk messages (``BlobChunk``,
``UpdateChunk``), and every request message of both services parsed by the deserializer
the server registers for it, then turned into core values where the edge does that."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from google.protobuf.message import DecodeError

from flotilla.core.errors import FlotillaError, WireError
from flotilla.proto import bulk
from flotilla.proto import flotilla_pb2 as pb
from flotilla.server.grpc.wire import conditions_of, header_from_pb, profile_from_pb, report_from_pb
from tests.fuzz.harness import Target, fuzz, mutate, mutated, recipes

pytestmark = [pytest.mark.fuzz, pytest.mark.xdist_group("fuzz"), pytest.mark.timeout(300)]

_SHA = "ab" * 32
_HEADER = pb.UpdateHeader(
    job_id="job-1", round=3, round_token="t" * 32, num_samples=10, metrics={"loss": 0.5},
    payload_size=2048, payload_sha256=_SHA, codec="int8", reservation="r-1",
)  # fmt: skip
BULK_SEEDS = (
    bulk.blob_chunk(b"\x01" * 300, 1024, 4096, _SHA),
    bulk.update_data(b"\x02" * 300),
    bulk.update_header(_HEADER),
    bulk.update_header(_HEADER) + bulk.update_data(b"x" * 16),
)


def read_bulk(data: bytes) -> None:
    refused: FlotillaError | None = None
    for read in (bulk.read_blob_chunk, bulk.read_update_chunk):
        try:
            read(data)
        except WireError as exc:
            refused = exc
    for field in (1, 2):
        bulk.split_bytes_field(data, field)
    if refused is not None:
        raise refused


BULK = Target("proto-bulk", read_bulk, (WireError,))


def test_bulk_frames_parse_or_raise_our_errors() -> None:
    fuzz(BULK, mutated(BULK_SEEDS), BULK_SEEDS)


def _deserializers() -> dict[str, Callable[[bytes], object]]:
    """Every request deserializer as ``flotilla.proto.handlers.register`` installs them on
    the server (``server/grpc/edge.py`` overrides SubmitUpdate with the bulk reader)."""
    overrides = {"Agent.SubmitUpdate": bulk.read_update_chunk}
    out: dict[str, Callable[[bytes], object]] = {}
    for service in ("Agent", "Operator"):
        for method in pb.DESCRIPTOR.services_by_name[service].methods:
            key = f"{service}.{method.name}"
            out[key] = overrides.get(key, getattr(pb, method.input_type.name).FromString)
    return out


DESERIALIZERS = _deserializers()
_CONDITIONS = pb.DeviceConditions(battery=0.5, charging=True, network="wifi")
_PROFILE = pb.DeviceProfile(tasks=["a.b:C"], gflops=1.5, memory_bytes=1 << 30)
REQUEST_SEEDS = tuple(
    msg.SerializeToString()
    for msg in (
        pb.EnrolRequest(protocol_version=1, token="tok", profile=_PROFILE),
        pb.PollRequest(profile=_PROFILE, p2p_peer_id="Qm", conditions=_CONDITIONS),
        pb.HeartbeatRequest(round_token="t", conditions=_CONDITIONS),
        pb.FetchModelRequest(job_id="job-1", sha256=_SHA),
        pb.ReserveUploadRequest(job_id="job-1", round=2, round_token="t", payload_size=100),
        pb.AverageReport(
            job_id="j", round=1, model_sha256=_SHA, group_id="g", allreduce_seconds=1.0,
            contributors=[pb.Participation(device_id="d", num_samples=3, metrics={"a": 1.0})],
        ),
        pb.SubmitJobRequest(spec_json='{"job": {"name": "x"}}'),
        pb.GetJobRequest(job_id="job-1"),
        pb.SpeedChunk(data=b"z" * 64),
        pb.UpdateChunk(header=_HEADER),
    )
)  # fmt: skip


def _to_core(message: object) -> None:
    """What the edge makes of a parsed request before the core sees it."""
    if isinstance(message, pb.EnrolRequest):
        profile_from_pb(message.profile)
    elif isinstance(message, (pb.PollRequest, pb.HeartbeatRequest)):
        conditions_of(message)
        if isinstance(message, pb.PollRequest) and message.HasField("profile"):
            profile_from_pb(message.profile)
    elif isinstance(message, pb.AverageReport):
        report_from_pb("d", message)
    elif isinstance(message, bulk.UpdatePart) and message.header is not None:
        header_from_pb(message.header)


def parse_request(data: bytes) -> None:
    """Every deserializer on every input; refused only when all refuse."""
    refused: list[BaseException] = []
    for parse in DESERIALIZERS.values():
        try:
            _to_core(parse(data))
        except (FlotillaError, DecodeError) as exc:
            refused.append(exc)
    if len(refused) == len(DESERIALIZERS):
        raise refused[-1]


def _field_edit(message: bytes, rng: random.Random) -> bytes:
    """A seed with a field appended (protobuf merges repeats), then maybe mutated."""
    other = rng.choice(REQUEST_SEEDS)
    out = message + other[: rng.randint(0, len(other))]
    return mutate(out, rng) if rng.random() < 0.5 else out


#: protobuf's DecodeError is the generated deserializers' own refusal, which gRPC turns
#: into a failed call before any servicer runs.
REQUESTS = Target("proto-requests", parse_request, (FlotillaError, DecodeError))


def test_grpc_requests_parse_or_raise_our_errors() -> None:
    inputs = mutated(REQUEST_SEEDS) | recipes(REQUEST_SEEDS, _field_edit)
    fuzz(REQUESTS, inputs, REQUEST_SEEDS)
