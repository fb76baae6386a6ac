"""Devices report the training samples they hold per task (``DeviceProfile.samples``).

A gRPC device and an HTTP device each report a count at enrolment and a new one in a poll;
the pool, the database and the operator views hold the new value, and a server restarted on
the same database still has it. Every bad count is refused on both edges with a message that
names ``samples``, and changes nothing. A real ``flotilla client`` reports what its shard
holds once the task has loaded it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest

from flotilla.core.device import MAX_SAMPLES
from flotilla.core.timeouts import Timeouts
from flotilla.engine import EngineConfig
from flotilla.mobile.lite.data import ShardInfo, write_shard
from flotilla.mobile.lite.mlp import TASKS as LITE_TASKS
from flotilla.proto import PROTOCOL_VERSION
from flotilla.proto import flotilla_pb2 as pb
from flotilla.server.app import FederationServer, ServerConfig
from tests.support.databases import open_empty_store
from tests.support.lifetime import bound
from tests.support.live_grpc import CLIENT_OPTIONS, RPC_TIMEOUT, Device, LiveServer, refused
from tests.support.processes import AgentFleet, ServerProcess

pytestmark = pytest.mark.timeout(60)

DIGITS = "flotilla.tasks.digits:DigitsTask"
OTHER = "example.tasks:Other"
#: Counts no device may report, each with the words its refusal must hold.
BAD_COUNTS: tuple[tuple[dict[str, Any], str], ...] = (
    ({DIGITS: -1}, "integer from 0 to"),
    ({DIGITS: MAX_SAMPLES + 1}, "integer from 0 to"),
    ({f"t{i}.m:T": 1 for i in range(65)}, "at most 64"),
    ({"": 5}, "task names must be 1 to 256"),
    ({"x" * 257: 5}, "task names must be 1 to 256"),
)
#: What only JSON can say: not integers, or not an object.
BAD_JSON: tuple[tuple[Any, str], ...] = (
    ({DIGITS: 12.5}, "got 12.5"),
    ({DIGITS: 12.0}, "got 12.0"),
    ({DIGITS: "12"}, "got str"),
    ({DIGITS: True}, "got True"),
    ({DIGITS: None}, "got NoneType"),
    ([12], "must map task names"),
)


@asynccontextmanager
async def serving(state_dir: Path, db_url: str) -> AsyncIterator[tuple[LiveServer, str]]:
    """A server on both edges over ``db_url`` as it is (a restart keeps what is there), with
    polls held briefly; the live gRPC handle and the HTTP edge's base URL."""
    server = FederationServer(
        ServerConfig(
            host="127.0.0.1", port=0, state_dir=state_dir, db_url=db_url, http_port=0,
            timeouts=Timeouts(liveness_s=30.0, poll_hold_s=0.2),
            engine=EngineConfig(selection_grace_s=0.2),
        )
    )  # fmt: skip
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CLIENT_OPTIONS)
    sync_channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CLIENT_OPTIONS)
    live = LiveServer(server, channel, sync_channel)
    try:
        yield live, f"http://127.0.0.1:{server.http_port}"
    finally:
        await live.close()
        await server.stop(grace_s=0.2)


async def _empty(db_url: str) -> None:
    store = await open_empty_store(db_url)  # a shared PostgreSQL database starts empty
    await store.close()


def profile_pb(samples: dict[str, int]) -> pb.DeviceProfile:
    return pb.DeviceProfile(tasks=[DIGITS], samples=samples)


async def grpc_poll(live: LiveServer, device: Device, samples: dict[str, int]) -> None:
    await live.agent.Poll(
        pb.PollRequest(profile=profile_pb(samples)), metadata=device.md, timeout=RPC_TIMEOUT
    )


async def listed(live: LiveServer, device_id: str) -> dict[str, int]:
    """The device's counts as ``flotilla devices list`` reads them (gRPC ListDevices)."""
    reply = await live.operator.ListDevices(
        pb.ListDevicesRequest(), metadata=live.op_md, timeout=RPC_TIMEOUT
    )
    return next(dict(d.samples) for d in reply.devices if d.id == device_id)


async def held(live: LiveServer, device_id: str) -> tuple[dict[str, int], dict[str, int]]:
    """(what the database holds, what the pool selects by) for the device."""
    record = await live.store.get_device(device_id)
    assert record is not None
    profile = live.server.federation.device_profile(device_id)
    return record.samples, {} if profile is None else dict(profile.samples)


async def test_a_grpc_device_reports_samples_at_enrolment_and_in_a_poll(
    db_url: str, tmp_path: Path
) -> None:
    await _empty(db_url)
    async with serving(tmp_path / "state", db_url) as (live, _):
        token = await live.enrol_token()
        before = await live.snapshot()
        for samples, needle in BAD_COUNTS:
            request = pb.EnrolRequest(
                protocol_version=PROTOCOL_VERSION, token=token, profile=profile_pb(samples)
            )
            call = live.agent.Enrol(request, timeout=RPC_TIMEOUT)
            await refused(call, grpc.StatusCode.INVALID_ARGUMENT, "'samples'", needle)
        assert await live.snapshot() == before, "a refused enrolment wrote nothing"

        reply = await live.agent.Enrol(
            pb.EnrolRequest(
                protocol_version=PROTOCOL_VERSION, token=token, profile=profile_pb({DIGITS: 120})
            ),
            timeout=RPC_TIMEOUT,
        )
        device = Device(reply.device_id, reply.credential)
        assert (await held(live, device.device_id))[0] == {DIGITS: 120}
        await grpc_poll(live, device, {DIGITS: 150, OTHER: 7})
        assert await held(live, device.device_id) == ({DIGITS: 150, OTHER: 7},) * 2
        assert await listed(live, device.device_id) == {DIGITS: 150, OTHER: 7}

        before = await live.snapshot()
        for samples, needle in BAD_COUNTS:
            call = grpc_poll(live, device, samples)
            await refused(call, grpc.StatusCode.INVALID_ARGUMENT, "'samples'", needle)
        assert await live.snapshot() == before, "a refused poll wrote nothing"
        assert await held(live, device.device_id) == ({DIGITS: 150, OTHER: 7},) * 2

    async with serving(tmp_path / "state", db_url) as (live, _):
        assert await listed(live, device.device_id) == {DIGITS: 150, OTHER: 7}
        await live.agent.Poll(pb.PollRequest(), metadata=device.md, timeout=RPC_TIMEOUT)
        assert await held(live, device.device_id) == ({DIGITS: 150, OTHER: 7},) * 2


async def post(
    http: aiohttp.ClientSession, url: str, body: Any, auth: str = ""
) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {auth}"} if auth else {}
    async with http.post(url, data=json.dumps(body), headers=headers) as r:
        return r.status, await r.json()


async def test_an_http_device_reports_samples_at_enrolment_and_in_a_poll(
    db_url: str, tmp_path: Path
) -> None:
    await _empty(db_url)
    bad = (*BAD_COUNTS, *BAD_JSON)
    async with (
        serving(tmp_path / "state", db_url) as (live, base),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http,
    ):
        token = await live.enrol_token()

        def enrolment(samples: Any) -> dict[str, Any]:
            return {
                "protocol": 1,
                "token": token,
                "profile": {"tasks": [DIGITS], "samples": samples},
            }

        before = await live.snapshot()
        for samples, needle in bad:
            status, body = await post(http, f"{base}/device/v1/enrol", enrolment(samples))
            assert (status, body["error"]["code"]) == (400, "bad_request"), body
            message = body["error"]["message"]
            assert "profile: 'samples'" in message and needle in message, message
        assert await live.snapshot() == before, "a refused enrolment wrote nothing"

        status, body = await post(http, f"{base}/device/v1/enrol", enrolment({DIGITS: 80}))
        assert status == 201, body
        device_id, auth = body["device_id"], f"{body['device_id']}:{body['credential']}"
        assert (await held(live, device_id))[0] == {DIGITS: 80}
        poll = {"profile": {"tasks": [DIGITS], "samples": {DIGITS: 95}}}
        assert (await post(http, f"{base}/device/v1/poll", poll, auth))[0] == 200
        assert await held(live, device_id) == ({DIGITS: 95},) * 2
        assert await listed(live, device_id) == {DIGITS: 95}

        before = await live.snapshot()
        for samples, needle in bad:
            poll = {"profile": {"tasks": [DIGITS], "samples": samples}}
            status, body = await post(http, f"{base}/device/v1/poll", poll, auth)
            assert (status, body["error"]["code"]) == (400, "bad_request"), body
            assert needle in body["error"]["message"], body
        assert await live.snapshot() == before, "a refused poll wrote nothing"
        assert await held(live, device_id) == ({DIGITS: 95},) * 2

    async with (
        serving(tmp_path / "state", db_url) as (live, base),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http,
    ):
        assert await listed(live, device_id) == {DIGITS: 95}
        assert (await post(http, f"{base}/device/v1/poll", {}, auth))[0] == 200
        assert await held(live, device_id) == ({DIGITS: 95},) * 2
        devices = await live.server.federation.list_devices()
        assert [d.samples for d in devices if d.id == device_id] == [{DIGITS: 95}]


async def test_a_lite_client_reports_the_samples_its_data_file_holds(
    db_url: str, tmp_path: Path
) -> None:
    await _empty(db_url)
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.random((37, 64), dtype=np.float32), "y_train": rng.integers(0, 10, 37),
        "x_val": rng.random((5, 64), dtype=np.float32), "y_val": rng.integers(0, 10, 5),
    }  # fmt: skip
    write_shard(tmp_path / "mine.npz", arrays, ShardInfo(DIGITS, 0, 1, 0.5, 0, {}))
    async with serving(tmp_path / "state", db_url) as (live, base):
        argv = [
            sys.executable, "-m", "flotilla.mobile.lite", "--server", base,
            "--token", await live.enrol_token(), "--data", str(tmp_path / "mine.npz"),
            "--state-dir", str(tmp_path / "lite"),
        ]  # fmt: skip
        log = (tmp_path / "lite.log").open("wb")
        lite = await asyncio.create_subprocess_exec(*bound(argv), stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 20
            while not (devices := await live.store.list_devices()):
                assert lite.returncode is None, (tmp_path / "lite.log").read_text()
                assert time.monotonic() < deadline, "the lite client never enrolled"
                await asyncio.sleep(0.2)
        finally:
            lite.terminate()
            await lite.wait()
            log.close()
        # At enrolment: its data is one file, read whole before it connects.
        assert [d.samples for d in devices] == [{task: 37 for task in LITE_TASKS}]


def test_a_real_agent_reports_the_samples_its_shard_holds(
    server: ServerProcess, fleet: AgentFleet, digits_spec: Path
) -> None:
    from flotilla.core.spec import JobSpec
    from flotilla.tasks import Shard
    from flotilla.tasks.digits import DigitsTask

    fleet.start(1, of=2)  # shard 0/2
    job = server.submit(digits_spec, "job.rounds=1", "job.clients_per_round=1", "job.min_quorum=1")
    expected = DigitsTask().load_shard(Shard(0, 2), JobSpec.load(digits_spec).data).num_train
    assert 0 < expected < 1437
    # Counted when its first round loaded the shard, sent with the poll after it.
    assert asyncio.run(reported(server, timeout_s=40)) == {DIGITS: expected}
    server.wait_rounds(job, 1, timeout=20)
    [device] = json.loads(server.operator("devices", "list", "--json").stdout)
    assert device["samples"] == {DIGITS: expected}


async def reported(server: ServerProcess, timeout_s: float) -> dict[str, int]:
    """The first counts the server's one device reports (over one operator connection)."""
    from flotilla.cli.remote import RemoteServer, operator_token

    deadline = time.monotonic() + timeout_s
    async with RemoteServer(server.address, operator_token(server.state_dir, None)) as remote:
        while time.monotonic() < deadline:
            devices = await remote.devices()
            if devices and devices[0].samples:
                return dict(devices[0].samples)
            await asyncio.sleep(0.3)
    raise AssertionError(f"no device reported samples within {timeout_s}s")
