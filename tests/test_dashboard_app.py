"""The read app's own rules over a small in-memory model, on a real aiohttp server: tokens,
the error shape, cached answers dropped by changes, ``?since``, server-sent events. The
same routes over a live federation: test_http_api.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from flotilla.core.access import Scope
from flotilla.core.errors import NotFoundError
from flotilla.dashboard.app import ReadAppConfig, build_read_app
from flotilla.dashboard.events import StreamSettings
from flotilla.dashboard.guard import StaticTokens
from flotilla.dashboard.model import (
    Change,
    DeviceStatus,
    JobView,
    ReadModel,
    RoundView,
    VolunteerRunView,
)

pytestmark = pytest.mark.timeout(60)

OPERATOR, READER = "op-token", "read-token"


def job(job_id: str, committed: int) -> JobView:
    return JobView(job_id, "digits", "running", "t:T", committed, 10, {"accuracy": 0.5}, 1.0, 2.0)


def round_view(n: int) -> RoundView:
    return RoundView(n, {"loss": float("nan")}, ("d1",), (), float(n), n + 0.5, "ab" * 32)


@dataclass
class FakeModel:
    """A source whose contents a test sets, and which tells its subscribers."""

    job_list: list[JobView] = field(default_factory=lambda: [job("j1", 2)])
    round_list: list[RoundView] = field(default_factory=lambda: [round_view(1), round_view(2)])
    subscribers: list[asyncio.Queue[Change]] = field(default_factory=list)
    reads: int = 0

    async def jobs(self) -> Sequence[JobView]:
        self.reads += 1
        return list(self.job_list)

    async def rounds(self, job_id: str) -> Sequence[RoundView]:
        if job_id != "j1":
            raise NotFoundError(f"no job {job_id!r}")
        return list(self.round_list)

    async def devices(self) -> Sequence[DeviceStatus]:
        return [DeviceStatus("d1", "busy", "j1", "cpu", ("t:T",), 1.0, 2.0, 3.0, 4)]

    async def volunteer_runs(self) -> Sequence[VolunteerRunView]:
        return [VolunteerRunView("run", "t:T", 2, 10.0, ((1.0, 0.5),))]

    async def changes(self) -> AsyncIterator[Change]:
        queue: asyncio.Queue[Change] = asyncio.Queue()
        self.subscribers.append(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self.subscribers.remove(queue)

    def tell(self, change: Change) -> None:
        for q in self.subscribers:
            q.put_nowait(change)


@pytest.fixture
async def served() -> AsyncIterator[tuple[FakeModel, str, web.AppRunner]]:
    fake = FakeModel()
    model = ReadModel(jobs=fake, fleet=fake, changes=fake)
    tokens = StaticTokens({OPERATOR: Scope.OPERATOR, READER: Scope.READ})
    config = ReadAppConfig(streams=StreamSettings(keepalive_s=0.2, min_interval_s=0.5))
    runner = web.AppRunner(build_read_app(model, tokens, "simulation", config))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield fake, f"http://127.0.0.1:{port}", runner
    finally:
        await runner.cleanup()


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_tokens_errors_and_shapes(served: tuple[FakeModel, str, web.AppRunner]) -> None:
    _, base, _ = served
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/api/v1/jobs") as r:
            assert r.status == 401
            assert (await r.json())["error"]["code"] == "unauthorized"
            assert "Bearer" in r.headers["WWW-Authenticate"]
        async with http.get(f"{base}/api/v1/jobs", headers=auth("wrong")) as r:
            assert r.status == 401
        async with http.get(f"{base}/api/v1/whoami", headers=auth(READER)) as r:
            assert await r.json() == {"scope": "read", "source": "simulation"}
        async with http.get(f"{base}/api/v1/jobs/nope", headers=auth(READER)) as r:
            assert r.status == 404
            assert (await r.json())["error"]["code"] == "not_found"
        async with http.get(f"{base}/api/v1/nothing-here", headers=auth(READER)) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
        async with http.get(f"{base}/api/v1/jobs/j1/rounds?since=x", headers=auth(READER)) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "bad_request"
        async with http.get(f"{base}/api/v1/jobs/j1/rounds", headers=auth(READER)) as r:
            rounds = (await r.json())["rounds"]
        assert [x["round"] for x in rounds] == [1, 2]
        assert rounds[0]["metrics"] == {"loss": None}  # NaN is not JSON
        async with http.get(f"{base}/api/v1/jobs/j1/rounds?since=1", headers=auth(READER)) as r:
            assert [x["round"] for x in (await r.json())["rounds"]] == [2]
        async with http.get(f"{base}/api/v1/devices", headers=auth(OPERATOR)) as r:
            (device,) = (await r.json())["devices"]
        assert device["state"] == "busy" and device["job"] == "j1" and device["rounds_served"] == 4
        async with http.get(f"{base}/api/v1/volunteer-runs", headers=auth(READER)) as r:
            (run,) = (await r.json())["volunteer_runs"]
        assert run["loss_history"] == [[1.0, 0.5]]
        async with http.get(f"{base}/") as r:
            assert r.status == 200 and "html" in r.headers["Content-Type"]


async def test_a_change_drops_the_cached_answer(
    served: tuple[FakeModel, str, web.AppRunner],
) -> None:
    fake, base, _ = served
    async with aiohttp.ClientSession(headers=auth(READER)) as http:
        for _ in range(3):
            async with http.get(f"{base}/api/v1/jobs") as r:
                assert (await r.json())["jobs"][0]["rounds_committed"] == 2
        assert fake.reads == 1  # rendered once, served three times
        fake.job_list = [job("j1", 3)]
        fake.round_list = [*fake.round_list, round_view(3)]
        async with http.get(f"{base}/api/v1/jobs") as r:
            assert (await r.json())["jobs"][0]["rounds_committed"] == 2  # not told yet
        fake.tell(Change("job", "j1"))
        await asyncio.sleep(0.05)
        async with http.get(f"{base}/api/v1/jobs/j1") as r:
            assert (await r.json())["rounds_committed"] == 3
        async with http.get(f"{base}/api/v1/jobs/j1/rounds") as r:
            assert [x["round"] for x in (await r.json())["rounds"]] == [1, 2, 3]


async def test_events_stream_changes_and_end_on_stop(
    served: tuple[FakeModel, str, web.AppRunner],
) -> None:
    fake, base, runner = served
    async with (
        aiohttp.ClientSession(headers=auth(READER)) as http,
        http.get(f"{base}/api/v1/events") as r,
    ):
        assert r.headers["Content-Type"] == "text/event-stream"
        assert await r.content.readline() == b": connected\n"
        await r.content.readline()
        fake.tell(Change("job", "j1"))
        fake.tell(Change("job", "j1"))  # the same change twice: one event
        fake.tell(Change("devices"))
        lines = [await r.content.readline() for _ in range(6)]
        assert lines[0] == b"event: change\n"
        assert lines[1] == b'data: {"kind": "job", "job_id": "j1"}\n'
        assert lines[4] == b'data: {"kind": "devices", "job_id": ""}\n'
        assert await r.content.readline() == b": keepalive\n"
        await r.content.readline()
        # Changes soon after a batch wait for the interval and go as one batch, each once.
        loop = asyncio.get_running_loop()
        fake.tell(Change("job", "j1"))
        first = [await r.content.readline() for _ in range(3)]
        told = loop.time()
        assert first[1] == b'data: {"kind": "job", "job_id": "j1"}\n'
        for job in ("j1", "j2", "j1", "j2"):
            fake.tell(Change("job", job))
        batch = [await r.content.readline() for _ in range(6)]
        assert loop.time() - told >= 0.4  # the interval is 0.5 s
        assert [line for line in batch if line.startswith(b"data:")] == [
            b'data: {"kind": "job", "job_id": "j1"}\n',
            b'data: {"kind": "job", "job_id": "j2"}\n',
        ]
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(runner.cleanup(), 5)
        assert asyncio.get_running_loop().time() - started < 2.0
        assert await asyncio.wait_for(r.content.read(), 5) in (b"", b"\n")
    assert fake.subscribers == []
