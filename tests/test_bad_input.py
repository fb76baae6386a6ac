"""A real server fed bad input by a raw gRPC client: each refusal is clear and loses nothing.

Every bad update is refused with a status code and a detail that says what is wrong; then
the job has committed nothing, and a good update from the same device for the same round is
still accepted and commits the round with exactly that device.
"""

from __future__ import annotations

import asyncio
import json
import struct
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from flotilla.core.blobs import sha256_hex
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import ModelState, encode_state
from flotilla.core.timeouts import Timeouts
from flotilla.engine import EngineConfig
from flotilla.proto import flotilla_pb2 as pb
from flotilla.server.app import ServerConfig
from tests.support.live_grpc import (
    QUICK_JOB,
    RPC_TIMEOUT,
    SPEC,
    LiveServer,
    data_messages,
    live_server,
    refused,
    run_cli,
    signed,
    small_delta,
    update_header,
    update_messages,
)

pytestmark = pytest.mark.timeout(120)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
STALE = grpc.StatusCode.FAILED_PRECONDITION
MAX_MESSAGE_BYTES = ServerConfig().max_message_bytes  # what these servers run with


@pytest.fixture
async def live(db_url: str, tmp_path: Path) -> AsyncIterator[LiveServer]:
    """A live gRPC server on each database."""
    async with live_server(tmp_path / "state", db_url) as srv:
        yield srv


# --- job specs ---------------------------------------------------------------------------


async def test_submitted_spec_with_unknown_field_is_refused_by_name(live: LiveServer) -> None:
    before = await live.snapshot()
    good = JobSpec.load(SPEC, QUICK_JOB).to_dict()
    typo = json.loads(json.dumps(good))
    typo["job"]["rounds_totl"] = 3
    unknown_section = {**good, "trainning": {"local_epochs": 2}}
    for spec, field in ((typo, "job.rounds_totl"), (unknown_section, "trainning")):
        call = live.operator.SubmitJob(
            pb.SubmitJobRequest(spec_json=json.dumps(spec)), metadata=live.op_md, timeout=30
        )
        await refused(call, INVALID, f"unknown field '{field}'")
    assert await live.snapshot() == before, "a refused spec wrote nothing"
    listing = await live.operator.ListJobs(pb.ListJobsRequest(), metadata=live.op_md, timeout=10)
    assert list(listing.jobs) == []


async def test_cli_submit_with_unknown_field_exits_2_naming_field_and_file(
    tmp_path: Path,
) -> None:
    async with live_server(tmp_path / "state") as live:
        spec = tmp_path / "typo.toml"
        spec.write_text(SPEC.read_text().replace("[train]\n", "[train]\nlearning_rat = 0.1\n"))
        where = ("--server", f"127.0.0.1:{live.port}", "--state-dir", str(live.server.state_dir))
        result = await run_cli("job", "submit", str(spec), *where)
        assert result.returncode == 2, result
        assert "train.learning_rat" in result.stderr and str(spec) in result.stderr, result
        assert "Traceback" not in result.stderr

        result = await run_cli("job", "submit", str(SPEC), "--set", "job.bogus=1", *where)
        assert result.returncode == 2, result
        assert "job.bogus" in result.stderr and str(SPEC) in result.stderr, result
        assert await live.store.list_jobs() == []


# --- bad updates -------------------------------------------------------------------------


@dataclass(frozen=True)
class Bad:
    """A crafted SubmitUpdate stream and how the server must answer it."""

    build: Callable[[pb.TrainTask, ModelState], list[pb.UpdateChunk]]
    code: grpc.StatusCode
    needles: Callable[[ModelState], tuple[str, ...]]


def _first(model: ModelState) -> str:
    return next(iter(model))


def _last(model: ModelState) -> str:
    return list(model)[-1]


def _with(model: ModelState, name: str, value: np.ndarray) -> ModelState:
    delta = small_delta(model)
    delta[name] = value
    return delta


def _payload(model: ModelState) -> bytes:
    return encode_state(small_delta(model))


def _wrong_shape(task: pb.TrainTask, m: ModelState) -> list[pb.UpdateChunk]:
    name = _first(m)
    shape = (*m[name].shape[:-1], m[name].shape[-1] + 1)
    return update_messages(task, encode_state(_with(m, name, np.zeros(shape, np.float32))))


def _wrong_dtype(dtype: str) -> Callable[[pb.TrainTask, ModelState], list[pb.UpdateChunk]]:
    def build(task: pb.TrainTask, m: ModelState) -> list[pb.UpdateChunk]:
        name = _first(m)
        return update_messages(task, encode_state(_with(m, name, m[name].astype(dtype))))

    return build


def _missing(task: pb.TrainTask, m: ModelState) -> list[pb.UpdateChunk]:
    delta = small_delta(m)
    del delta[_last(m)]
    return update_messages(task, encode_state(delta))


def _extra(task: pb.TrainTask, m: ModelState) -> list[pb.UpdateChunk]:
    delta = small_delta(m)
    delta["backdoor.weight"] = np.zeros((4,), np.float32)
    return update_messages(task, encode_state(delta))


def _poisoned(value: float, pick: Callable[[ModelState], str]) -> Callable[..., list]:
    def build(task: pb.TrainTask, m: ModelState) -> list[pb.UpdateChunk]:
        delta = small_delta(m)
        delta[pick(m)].reshape(-1)[1] = value
        return update_messages(task, encode_state(delta))

    return build


def _truncated(task: pb.TrainTask, m: ModelState) -> list[pb.UpdateChunk]:
    payload = _payload(m)
    return [update_header(task, payload), *data_messages(payload[:-100])]


def _header_only(task: pb.TrainTask, m: ModelState) -> list[pb.UpdateChunk]:
    return [update_header(task, _payload(m))]


def _oversized_message(task: pb.TrainTask, m: ModelState) -> list[pb.UpdateChunk]:
    # One data message bigger than the server's max_message_bytes; the declared size is the
    # honest one so that it is gRPC's message limit, not the size check, that trips.
    return [update_header(task, _payload(m)), pb.UpdateChunk(data=bytes(MAX_MESSAGE_BYTES + 1024))]


def _oversized_declared(task: pb.TrainTask, m: ModelState) -> list[pb.UpdateChunk]:
    payload = _payload(m)
    return update_messages(task, payload, payload_size=2**40)


def _sha_mismatch(task: pb.TrainTask, m: ModelState) -> list[pb.UpdateChunk]:
    payload = _payload(m)
    return update_messages(task, payload, payload_sha256=sha256_hex(payload + b"x"))


def _sha_malformed(task: pb.TrainTask, m: ModelState) -> list[pb.UpdateChunk]:
    return update_messages(task, _payload(m), payload_sha256="not-a-digest")


def _data_first(task: pb.TrainTask, m: ModelState) -> list[pb.UpdateChunk]:
    payload = _payload(m)
    return [*data_messages(payload), update_header(task, payload)]


def _two_headers(task: pb.TrainTask, m: ModelState) -> list[pb.UpdateChunk]:
    payload = _payload(m)
    head = update_header(task, payload)
    return [head, head, *data_messages(payload)]


def _headers_between(task: pb.TrainTask, m: ModelState) -> list[pb.UpdateChunk]:
    payload = _payload(m)
    head = update_header(task, payload)
    data = data_messages(payload, chunk_bytes=len(payload) // 2 + 1)
    return [head, data[0], head, *data[1:]]


def _not_safetensors(task: pb.TrainTask, m: ModelState) -> list[pb.UpdateChunk]:
    junk = np.random.default_rng(0).bytes(len(_payload(m)))
    return update_messages(task, struct.pack("<Q", 2**62) + junk[8:])


def _lying_offsets(task: pb.TrainTask, m: ModelState) -> list[pb.UpdateChunk]:
    # A header claiming a 1 GiB tensor while 16 bytes follow: refused before any allocation.
    header = json.dumps({_first(m): {"dtype": "F32", "shape": [2**28], "data_offsets": [0, 2**30]}})
    raw = header.encode() + b" " * (-len(header) % 8)
    return update_messages(task, struct.pack("<Q", len(raw)) + raw + bytes(16))


BAD_UPDATES: dict[str, Bad] = {
    "truncated": Bad(_truncated, INVALID, lambda m: ("truncated",)),
    "header-only": Bad(_header_only, INVALID, lambda m: ("truncated",)),
    "wrong-shape": Bad(_wrong_shape, INVALID, lambda m: (repr(_first(m)), "shape")),
    "dtype-f64": Bad(_wrong_dtype("float64"), INVALID, lambda m: (repr(_first(m)), "F64", "F32")),
    "dtype-f16": Bad(_wrong_dtype("float16"), INVALID, lambda m: (repr(_first(m)), "F16", "F32")),
    "missing-tensor": Bad(_missing, INVALID, lambda m: ("missing", repr(_last(m)))),
    "extra-tensor": Bad(_extra, INVALID, lambda m: ("unexpected", "'backdoor.weight'")),
    "nan": Bad(_poisoned(float("nan"), _first), INVALID, lambda m: ("NaN", repr(_first(m)))),
    "inf": Bad(_poisoned(float("inf"), _last), INVALID, lambda m: ("Inf", repr(_last(m)))),
    "minus-inf": Bad(_poisoned(float("-inf"), _first), INVALID, lambda m: ("Inf",)),
    "message-over-limit": Bad(
        _oversized_message, grpc.StatusCode.RESOURCE_EXHAUSTED, lambda m: ("larger than max",)
    ),
    "declared-size-over-limit": Bad(
        _oversized_declared, INVALID, lambda m: (str(2**40), "exceeds the limit")
    ),
    "sha-mismatch": Bad(_sha_mismatch, INVALID, lambda m: ("sha256", "does not match")),
    "sha-malformed": Bad(_sha_malformed, INVALID, lambda m: ("sha256",)),
    "data-before-header": Bad(_data_first, INVALID, lambda m: ("first message", "header")),
    "two-headers": Bad(_two_headers, INVALID, lambda m: ("exactly one header",)),
    "header-mid-stream": Bad(_headers_between, INVALID, lambda m: ("exactly one header",)),
    "empty-stream": Bad(lambda task, m: [], INVALID, lambda m: ("header",)),
    "not-safetensors": Bad(_not_safetensors, INVALID, lambda m: ("safetensors header",)),
    "lying-offsets": Bad(_lying_offsets, INVALID, lambda m: (repr(_first(m)), "out of bounds")),
    "zero-samples": Bad(
        lambda task, m: update_messages(task, _payload(m), num_samples=0),
        INVALID,
        lambda m: ("num_samples",),
    ),
    "negative-samples": Bad(
        lambda task, m: update_messages(task, _payload(m), num_samples=-5),
        INVALID,
        lambda m: ("num_samples",),
    ),
    "unknown-codec": Bad(
        lambda task, m: update_messages(task, _payload(m), codec="pickle"),
        INVALID,
        lambda m: ("codec", "pickle"),
    ),
    "stale-round-token": Bad(
        lambda task, m: update_messages(task, _payload(m), round_token=uuid.uuid4().hex),
        STALE,
        lambda m: ("stale",),
    ),
    "missing-round-token": Bad(
        lambda task, m: update_messages(task, _payload(m), round_token=""),
        STALE,
        lambda m: ("stale",),
    ),
    "wrong-round-number": Bad(
        lambda task, m: update_messages(task, _payload(m), round=task.round + 1),
        STALE,
        lambda m: ("stale",),
    ),
    "wrong-job": Bad(
        lambda task, m: update_messages(task, _payload(m), job_id="job-0000000000"),
        STALE,
        lambda m: ("stale",),
    ),
}


@pytest.fixture
async def sqlite_live(tmp_path: Path) -> AsyncIterator[LiveServer]:
    async with live_server(tmp_path / "state") as srv:
        yield srv


@pytest.mark.parametrize("case", list(BAD_UPDATES))
async def test_bad_update_is_refused_and_loses_nothing(sqlite_live: LiveServer, case: str) -> None:
    """Each case on a fresh server, so a failure names its case; the refusals happen before
    any database write, so the next test runs the whole catalogue on every database."""
    live, bad = sqlite_live, BAD_UPDATES[case]
    device = await live.enrol()
    job_id = await live.submit()
    task = await live.poll_task(device)
    model = await live.fetch(device, task)
    before = await live.row_counts()

    call = live.send_update(device, bad.build(task, model))
    await refused(call, bad.code, *bad.needles(model))

    await live.assert_nothing_committed(job_id)
    assert await live.row_counts() == before, "a refused update wrote nothing"
    await live.good_update_commits(job_id, device, task, model)


async def test_every_bad_update_in_turn_then_a_good_one(live: LiveServer) -> None:
    """One round survives the whole catalogue from one device, then commits its good update."""
    device = await live.enrol()
    job_id = await live.submit()
    task = await live.poll_task(device)
    model = await live.fetch(device, task)
    before = await live.snapshot()
    for case, bad in BAD_UPDATES.items():
        try:
            await refused(live.send_update(device, bad.build(task, model)), bad.code)
            await live.assert_nothing_committed(job_id)
        except AssertionError as exc:
            raise AssertionError(f"{case}: {exc}") from exc
    assert await live.snapshot() == before, "refused updates changed the database"
    await live.good_update_commits(job_id, device, task, model)


async def test_update_after_the_round_committed_is_stale(live: LiveServer) -> None:
    device = await live.enrol()
    job_id = await live.submit()
    task = await live.poll_task(device)
    model = await live.fetch(device, task)
    replay = update_messages(task, encode_state(small_delta(model)))
    await live.good_update_commits(job_id, device, task, model)
    committed = await live.snapshot()

    await refused(live.send_update(device, replay), STALE, "stale")
    job = await live.store.get_job(job_id)
    assert job is not None and job.rounds_committed == 1
    rows = await live.store.list_participations(job_id)
    assert [(p.round, p.device_id) for p in rows] == [(1, device.device_id)]
    after = await live.snapshot()
    assert after["participations"] == committed["participations"]
    assert after["rounds"] == committed["rounds"]

    # The device is not wedged by its replay: it takes round 2 and finishes the job.
    task2 = await live.poll_task(device)
    assert task2.round == 2 and task2.round_token != task.round_token
    model2 = await live.fetch(device, task2)
    await live.good_update_commits(job_id, device, task2, model2)
    await live.wait_state(job_id, "completed")
    rows = await live.store.list_participations(job_id)
    assert [(p.round, p.device_id) for p in rows] == [(1, device.device_id), (2, device.device_id)]


async def test_device_not_selected_cannot_submit_into_the_round(live: LiveServer) -> None:
    chosen = await live.enrol()
    intruder = await live.enrol()
    job_id = await live.submit()
    task = await live.poll_task(chosen)
    model = await live.fetch(chosen, task)
    # The intruder knows the round token (say it sniffed it) and has a valid credential.
    payload = encode_state(small_delta(model, 10.0))
    await refused(live.send_update(intruder, update_messages(task, payload)), STALE, "stale")
    await live.assert_nothing_committed(job_id)
    await live.good_update_commits(job_id, chosen, task, model)
    rows = await live.store.list_participations(job_id)
    assert intruder.device_id not in {p.device_id for p in rows}


class Stalled:
    """An upload that sends its header and first chunk, then hangs until released."""

    def __init__(self, messages: list[pb.UpdateChunk], finish: bool) -> None:
        self.messages, self.finish = messages, finish
        self.stuck = threading.Event()
        self.release = threading.Event()

    def __iter__(self) -> Iterator[pb.UpdateChunk]:
        yield from self.messages[:2]
        self.stuck.set()
        self.release.wait(RPC_TIMEOUT)  # a phone whose link died mid-upload
        if self.finish:
            yield from self.messages[2:]

    async def wait_stuck(self) -> None:
        assert await asyncio.to_thread(self.stuck.wait, RPC_TIMEOUT)
        await asyncio.sleep(0.5)  # and the server has what was sent


async def test_a_stalled_upload_holds_up_no_other_device(sqlite_live: LiveServer) -> None:
    live = sqlite_live
    slow, quick = await live.enrol(), await live.enrol()
    job_id = await live.submit("job.clients_per_round=2", "job.min_quorum=2")
    task, _ = await asyncio.gather(live.poll_task(slow), live.poll_task(quick))
    model = await live.fetch(slow, task)
    messages = update_messages(task, encode_state(small_delta(model)), 4096)
    stalled = Stalled([signed(m, slow.identity) for m in messages], finish=True)
    slow_call = asyncio.ensure_future(
        live.stream_call(live.sync_agent.SubmitUpdate, stalled, slow.md)
    )
    try:
        await stalled.wait_stuck()
        good = update_messages(task, encode_state(small_delta(model)))
        reply = await asyncio.wait_for(live.send_update(quick, good), 10)
        assert reply.accepted, "the quick device's upload went through while the slow one hung"
        await live.assert_nothing_committed(job_id)
    finally:
        stalled.release.set()
    assert (await slow_call).accepted
    await live.wait_committed(job_id, 1)
    rows = await live.store.list_participations(job_id)
    assert sorted(p.device_id for p in rows) == sorted([slow.device_id, quick.device_id])


async def test_a_device_uploads_one_update_at_a_time(sqlite_live: LiveServer) -> None:
    """A second stream from a device waits for its first, so it cannot multiply its buffers."""
    live = sqlite_live
    device = await live.enrol()
    job_id = await live.submit()
    task = await live.poll_task(device)
    model = await live.fetch(device, task)
    payload = encode_state(small_delta(model))
    messages = [signed(m, device.identity) for m in update_messages(task, payload, 4096)]
    stalled = Stalled(messages, finish=False)
    first = asyncio.ensure_future(
        live.stream_call(live.sync_agent.SubmitUpdate, stalled, device.md)
    )
    try:
        await stalled.wait_stuck()
        second = asyncio.ensure_future(live.send_update(device, update_messages(task, payload)))
        await asyncio.sleep(1.0)
        assert not second.done(), "a second upload ran beside the first"
        await live.assert_nothing_committed(job_id)
    finally:
        stalled.release.set()
    await refused(first, INVALID, "truncated")
    assert (await second).accepted
    await live.wait_committed(job_id, 1)
    rows = await live.store.list_participations(job_id)
    assert [(p.round, p.device_id) for p in rows] == [(1, device.device_id)]


async def test_a_stalled_upload_is_cut_off_once_its_round_is_over(sqlite_live: LiveServer) -> None:
    live = sqlite_live
    device = await live.enrol()
    job_id = await live.submit("job.round_deadline_s=1.5")
    task = await live.poll_task(device)
    model = await live.fetch(device, task)
    payload = encode_state(small_delta(model))
    messages = [signed(m, device.identity) for m in update_messages(task, payload, 4096)]
    stalled = Stalled(messages, finish=True)
    started = asyncio.get_running_loop().time()
    call = live.stream_call(live.sync_agent.SubmitUpdate, stalled, device.md)
    try:
        await refused(call, STALE, "stale", "before this update finished uploading")
    finally:
        stalled.release.set()
    # Cut off at the deadline plus the server's grace, not when the client gives up.
    assert asyncio.get_running_loop().time() - started < RPC_TIMEOUT - 3
    await live.assert_nothing_committed(job_id)
    # The device is not wedged behind its dead upload: the next answer comes at once.
    replay = asyncio.wait_for(live.send_update(device, update_messages(task, payload)), 3)
    await refused(replay, STALE, "stale")


# --- upload reservations --------------------------------------------------------------------


def _reserve(task: pb.TrainTask, size: int) -> pb.ReserveUploadRequest:
    return pb.ReserveUploadRequest(
        job_id=task.job_id, round=task.round, round_token=task.round_token, payload_size=size
    )


async def test_a_reserved_upload_streams_and_gives_its_room_back(tmp_path: Path) -> None:
    async with live_server(tmp_path / "state", upload_budget_bytes=1 << 20) as live:
        device = await live.enrol()
        job_id = await live.submit()
        task = await live.poll_task(device)
        payload = encode_state(small_delta(await live.fetch(device, task)))
        reply = await live.agent.ReserveUpload(_reserve(task, len(payload)), metadata=device.md)
        assert reply.reservation and reply.expires_in_s > 0
        budget = live.server.upload_budget
        assert budget.used == len(payload), "the room is held before any data moves"
        messages = update_messages(task, payload, reservation=reply.reservation)
        assert (await live.send_update(device, messages)).accepted
        assert budget.used == 0
        await live.wait_committed(job_id, 1)


async def test_unused_reservations_expire(tmp_path: Path) -> None:
    timeouts = Timeouts(liveness_s=30.0, poll_hold_s=5.0, upload_idle_s=0.5)
    async with live_server(tmp_path / "state", timeouts=timeouts) as live:
        device = await live.enrol()
        await live.submit()
        task = await live.poll_task(device)
        payload = encode_state(small_delta(await live.fetch(device, task)))
        reply = await live.agent.ReserveUpload(_reserve(task, len(payload)), metadata=device.md)
        assert live.server.upload_budget.used == len(payload)
        await asyncio.sleep(1.5)
        assert live.server.upload_budget.used == 0, "an unused reservation goes back"
        late = update_messages(task, payload, reservation=reply.reservation)
        await refused(live.send_update(device, late), INVALID, "unknown or expired")


async def test_reservations_are_checked_like_uploads(sqlite_live: LiveServer) -> None:
    live = sqlite_live
    device = await live.enrol()
    await live.submit()
    task = await live.poll_task(device)
    stale = _reserve(task, 1000)
    stale.round_token = "not-this-round"
    await refused(live.agent.ReserveUpload(stale, metadata=device.md), STALE, "stale round")
    huge = _reserve(task, 1 << 40)
    await refused(live.agent.ReserveUpload(huge, metadata=device.md), INVALID, "exceeds")
    other = await live.enrol()
    theirs = await live.agent.ReserveUpload(_reserve(task, 1000), metadata=device.md)
    payload = encode_state(small_delta(await live.fetch(device, task)))
    borrowed = update_messages(task, payload, reservation=theirs.reservation)
    await refused(live.send_update(other, borrowed), STALE, "stale round")
    assert live.server.upload_budget.used == 1000, "a refused stranger frees nothing"


async def test_a_round_refused_again_and_again_fails_its_job(tmp_path: Path) -> None:
    """Each update is finite, but their weighted sum overflows float32: the aggregate is
    refused, and after ``max_refused_rounds`` tries in a row the job fails instead of
    holding its devices forever."""
    engine = EngineConfig(selection_grace_s=0.2, max_refused_rounds=2)
    async with live_server(tmp_path / "state", engine=engine) as live:
        device = await live.enrol()
        job_id = await live.submit()
        for _ in range(2):
            task = await live.poll_task(device)
            model = await live.fetch(device, task)
            huge = encode_state(small_delta(model, value=3e38))
            assert (await live.send_update(device, update_messages(task, huge))).accepted
        await live.wait_state(job_id, "failed")
        await live.assert_nothing_committed(job_id)


# --- server-less (p2p) rounds ---------------------------------------------------------------


def _average_report(task: pb.TrainTask, device_id: str, sha: str) -> pb.AverageReport:
    return pb.AverageReport(
        job_id=task.job_id,
        round=task.round,
        round_token=task.round_token,
        model_sha256=sha,
        group_id="g",
        contributors=[pb.Participation(device_id=device_id, num_samples=10)],
    )


async def test_reports_belong_to_server_less_rounds_only(sqlite_live: LiveServer) -> None:
    live = sqlite_live
    device = await live.enrol()
    job_id = await live.submit()
    task = await live.poll_task(device)
    report = _average_report(task, device.device_id, "ab" * 32)
    await refused(live.agent.ReportAverage(report, metadata=device.md, timeout=10), INVALID, "p2p")
    await live.assert_nothing_committed(job_id)


async def test_server_less_round_refuses_bad_reports_and_unasked_uploads(
    sqlite_live: LiveServer,
) -> None:
    """Over the real gRPC service and the server's real rendezvous peer: a malformed report
    and an upload nobody asked for are refused; the honest report and upload commit."""
    from flotilla.compression import apply_average
    from flotilla.core.tensors import state_sha256

    live = sqlite_live
    device = await live.enrol()
    job_id = await live.submit(
        "aggregation.transport=p2p", "job.clients_per_round=1", "job.min_quorum=1",
        "aggregation.matchmaking_s=2",
    )  # fmt: skip
    bad_peer = pb.PollRequest(p2p_peer_id="not/a peer id")
    await refused(live.agent.Poll(bad_peer, metadata=device.md, timeout=30), INVALID, "peer id")
    peer_id = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    task = await live.poll_task(device, timeout=90, p2p_peer_id=peer_id)  # rendezvous first
    plan = json.loads(task.config_json)["p2p"]
    assert plan["group_size"] == 1 and plan["initial_peers"]
    assert plan["members"] == {peer_id: device.device_id}  # only this peer may join
    model = await live.fetch(device, task)
    average = small_delta(model)
    sha = state_sha256(apply_average(model, average))
    md = device.md

    bad = _average_report(task, device.device_id, "not-a-hash")
    await refused(live.agent.ReportAverage(bad, metadata=md, timeout=10), INVALID, "64")
    upload = update_messages(task, encode_state(average))
    await refused(live.send_update(device, upload), INVALID, "upload only when asked")
    reply = await live.agent.ReportAverage(
        _average_report(task, device.device_id, sha), metadata=md, timeout=10
    )
    assert reply.upload and reply.round_open
    await live.send_update(device, upload)
    await live.wait_committed(job_id, 1)
    job = await live.get_job(job_id, with_rounds=True)
    assert job.rounds[0].checkpoint_sha256 == sha
    assert list(job.rounds[0].participants) == [device.device_id]
