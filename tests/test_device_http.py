"""The HTTP device protocol against a real server: a device that speaks only HTTP enrols,
polls, downloads and uploads like a gRPC agent and its update commits; downloads and
uploads resume after broken connections; a digits job takes HTTP and gRPC devices at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.device_http import enrolled, off_loop, small_update, task_of
from tests.support.http_server import http_server, quick_toml, wait_until

pytestmark = pytest.mark.timeout(120)


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
        assert sent.accepted and sent.bytes_sent == len(update) and sent.resumes == 0

        async def committed() -> bool:
            return (await s.fleet.status(job["id"]))["rounds_committed"] == 1

        await wait_until(committed, 30, "round 1")
        rows = await s.server.store.list_participations(job["id"])
        assert [(p.device_id, p.num_samples) for p in rows] == [(device.credential.device_id, 7)]
