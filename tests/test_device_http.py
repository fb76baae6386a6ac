"""The HTTP device protocol against a real server: a device that speaks only HTTP enrols,
polls, downloads and uploads like a gRPC agent and its update commits; downloads and
uploads resume after broken connections; a digits job takes HTTP and gRPC devices at once."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
from pathlib import Path

import pytest

from flotilla.client import Agent, AgentConfig, LocalTrainer
from flotilla.mobile.lite.http import HttpDevice
from flotilla.tasks import Shard, ShardTraining
from tests.support.cutproxy import cut_proxy
from tests.support.device_http import (
    DEVICE_TIMEOUTS,
    enrolled,
    off_loop,
    small_update,
    task_of,
)
from tests.support.device_schemas import check
from tests.support.http_server import http_server, quick_toml, wait_until
from tests.support.inproc import DIGITS

pytestmark = pytest.mark.timeout(120)

CHUNK = 16 * 1024


async def test_an_http_device_enrols_polls_downloads_uploads_and_its_round_commits(
    db_url: str, tmp_path: Path
) -> None:
    async with http_server(tmp_path / "state", db_url) as s:
        device = await enrolled(s.base, await s.fleet.enrol_token())
        status, job = await s.submit_toml(quick_toml(rounds=1, clients=1))
        assert status == 201, job
        task = await task_of(device, job["id"])
        receipt = await off_loop(device.download_model, task.order, tmp_path / "model.st")
        update = small_update(receipt.path.read_bytes())
        sent = await off_loop(device.upload, task.order, update, 7)
        assert sent.accepted and sent.bytes_sent == len(update) and sent.broken_calls == 0

        async def committed() -> bool:
            return (await s.fleet.status(job["id"]))["rounds_committed"] == 1

        await wait_until(committed, 30, "round 1")
        rows = await s.server.store.list_participations(job["id"])
        assert [(p.device_id, p.num_samples) for p in rows] == [(device.credential.device_id, 7)]


async def test_an_http_device_given_two_servers_moves_on_from_one_that_is_down(
    tmp_path: Path,
) -> None:
    """``--server A,B`` for a deployment: the call to the dead A fails as Unreachable, the
    next goes to B and enrols (a 503 that sends the device on is passed over the same way)."""
    from flotilla.core.device import DeviceProfile
    from flotilla.core.errors import Unreachable

    sqlite = f"sqlite:///{tmp_path / 'state' / 'flotilla.db'}"
    async with http_server(tmp_path / "state", sqlite) as s:
        device = HttpDevice(f"http://127.0.0.1:1,{s.base}", timeouts=DEVICE_TIMEOUTS)
        token = await s.fleet.enrol_token()
        profile = DeviceProfile("", tasks=(DIGITS,), gflops=1.0)
        with pytest.raises(Unreachable):
            await off_loop(device.enrol, token, profile)
        credential = await off_loop(device.enrol, token, profile)
        assert credential.device_id.startswith("dev-")


async def test_an_upload_cut_at_five_random_offsets_resumes_and_commits_once(
    db_url: str, tmp_path: Path
) -> None:
    async with http_server(tmp_path / "state", db_url) as s:
        direct = await enrolled(s.base, await s.fleet.enrol_token())
        status, job = await s.submit_toml(quick_toml(rounds=1, clients=1))
        assert status == 201, job
        task = await task_of(direct, job["id"])
        model = await off_loop(direct.download_model, task.order, tmp_path / "model.st")
        update = small_update(model.path.read_bytes())
        cuts = sorted(random.Random(15).sample(range(300, len(update)), 5))
        async with cut_proxy(s.server.http_port or 0, cut_up=cuts) as proxy:
            flaky = HttpDevice(f"http://127.0.0.1:{proxy.port}", direct.credential, DEVICE_TIMEOUTS)
            flaky.identity = direct.identity
            sent = await off_loop(flaky.upload, task.order, update, 5, chunk_bytes=CHUNK)
        assert proxy.cuts_done == 5 and sent.accepted and sent.broken_calls == 5, (proxy, sent)
        # Each break costs at most the chunk it cut: resumed from the last one acknowledged.
        assert len(update) <= sent.bytes_sent <= len(update) + 5 * CHUNK

        async def committed() -> bool:
            return (await s.fleet.status(job["id"]))["rounds_committed"] == 1

        await wait_until(committed, 30, "round 1")
        rows = await s.server.store.list_participations(job["id"])
        assert [(p.device_id, p.num_samples) for p in rows] == [(direct.credential.device_id, 5)]
        again = await off_loop(direct.upload_status, sent.upload_id)
        assert again["state"] == "accepted" and again["missing"] == []


async def test_a_download_cut_midway_resumes_with_range_and_the_sha256_matches(
    db_url: str, tmp_path: Path
) -> None:
    async with http_server(tmp_path / "state", db_url) as s:
        direct = await enrolled(s.base, await s.fleet.enrol_token())
        status, job = await s.submit_toml(quick_toml(rounds=1, clients=1))
        assert status == 201, job
        task = await task_of(direct, job["id"])
        size = task.order.model_size
        async with cut_proxy(s.server.http_port or 0, cut_down=[size // 2, size]) as proxy:
            flaky = HttpDevice(f"http://127.0.0.1:{proxy.port}", direct.credential, DEVICE_TIMEOUTS)
            flaky.identity = direct.identity
            got = await off_loop(flaky.download_model, task.order, tmp_path / "model.st")
        assert proxy.cuts_done == 2 and len(got.resumed_at) == 2, (proxy, got)
        assert 0 < got.resumed_at[0] < got.resumed_at[1] < size
        data = got.path.read_bytes()
        assert len(data) == size and hashlib.sha256(data).hexdigest() == task.order.model_sha256
        assert not (tmp_path / "model.st.part").exists()
        # Then it gives the round up (its conditions changed): recorded at once.
        ref = task.order.ref
        report = {"job_id": ref.job_id, "round": ref.round, "round_token": ref.round_token}
        report["reason"] = "unplugged"
        check("failure-request", report)
        headers = {
            "Authorization": f"Bearer {direct.credential.device_id}:{direct.credential.secret}"
        }
        async with s.http.post(f"{s.base}/device/v1/failure", json=report, headers=headers) as r:
            assert r.status == 200 and r.headers["Flotilla-Protocol"] == "1"
            check("failure-response", await r.json())
        async with s.http.post(f"{s.base}/device/v1/failure", json=report, headers=headers) as r:
            assert r.status == 410, "a round given up is no longer this device's"


async def _http_rounds(device: HttpDevice, job_id: str, rounds: int, work: Path) -> None:
    """An HTTP device serving ``rounds`` rounds of a job: poll, download, upload."""
    for _ in range(rounds):
        task = await task_of(device, job_id, timeout_s=60)
        model = await off_loop(device.download_model, task.order, work / "model.st")
        await off_loop(device.upload, task.order, small_update(model.path.read_bytes()), 20)


@pytest.mark.timeout(180)
async def test_http_devices_and_a_grpc_agent_contribute_to_the_same_committed_rounds(
    db_url: str, tmp_path: Path
) -> None:
    async with http_server(tmp_path / "state", db_url) as s:
        token = await s.fleet.enrol_token()
        config = AgentConfig(
            server=f"127.0.0.1:{s.server.port}",
            token=token,
            trainer=LocalTrainer(ShardTraining(DIGITS, Shard(0, 3))),
            timeouts=DEVICE_TIMEOUTS,
            speed_test_bytes=64 * 1024,
        )
        agent = Agent(config, rng=random.Random(1))  # gRPC to the server's agent port
        run = asyncio.ensure_future(agent.run())
        try:
            phones = [await enrolled(s.base, token) for _ in range(2)]
            status, job = await s.submit_toml(quick_toml(rounds=2, clients=3))
            assert status == 201, job
            dirs = [tmp_path / f"phone{i}" for i in range(2)]
            for d in dirs:
                d.mkdir()
            await asyncio.gather(
                *(_http_rounds(p, job["id"], 2, d) for p, d in zip(phones, dirs, strict=True))
            )

            async def committed() -> bool:
                return (await s.fleet.status(job["id"]))["rounds_committed"] == 2

            await wait_until(committed, 60, "both rounds")
        finally:
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(run, 10)
        rows = await s.server.store.list_participations(job["id"])
        ids = {p.credential.device_id for p in phones if p.credential} | {agent.device_id}
        for round_no in (1, 2):
            assert {p.device_id for p in rows if p.round == round_no} == ids, rows
