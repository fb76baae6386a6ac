"""``/api/v1/events`` on a running federation: a subscriber hears of each round's commit and
of devices leaving; subscribers that never read hold nothing up; stopping the server ends
every stream at once."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from flotilla.dashboard.model import Change
from flotilla.server.http.feed import LiveFeed
from tests.support.http_server import HttpServer, http_server, quick_toml, wait_until

pytestmark = pytest.mark.timeout(120)


class Listener:
    """One page's event stream, read in the background: ``(received at, change)``."""

    def __init__(self, s: HttpServer) -> None:
        self.heard: list[tuple[float, Change]] = []
        self.ended = asyncio.Event()
        self._task = asyncio.ensure_future(self._listen(s))

    async def _listen(self, s: HttpServer) -> None:
        headers = s.headers(s.read_token)
        async with s.http.get(f"{s.base}/api/v1/events", headers=headers) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            async for line in r.content:
                if line.startswith(b"data: "):
                    data = json.loads(line[len(b"data: ") :])
                    self.heard.append((time.time(), Change(data["kind"], data["job_id"])))
        self.ended.set()

    def kinds(self, since: float = 0.0) -> set[Change]:
        return {c for t, c in self.heard if t >= since}

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def stuck_client(s: HttpServer) -> asyncio.StreamWriter:
    """Subscribes to the events and never reads a byte of them."""
    _, writer = await asyncio.open_connection("127.0.0.1", s.server.http_port)
    writer.write(
        f"GET /api/v1/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {s.read_token}\r\n\r\n"
        .encode()
    )  # fmt: skip
    await writer.drain()
    return writer


async def test_a_page_hears_rounds_commit_and_devices_leave(db_url: str, tmp_path: Path) -> None:
    async with http_server(tmp_path / "state", db_url) as s:
        page = Listener(s)
        stuck = [await stuck_client(s) for _ in range(20)]
        await wait_until(lambda: _subscribers(s, 1 + 20 + 1), 10, "every stream subscribed")
        await s.fleet.start_agents(2)
        await wait_until(lambda: _has(page, Change("devices")), 30, "agents' arrival heard")
        status, job = await s.submit_toml(quick_toml(rounds=3))
        assert status == 201
        await s.fleet.wait_for(job["id"], timeout=90)
        rounds = await s.server.store.list_rounds(job["id"])
        last = Change("job", job["id"])
        # Pages hear of changes at most once a second, in batches: the last commit soon.
        await wait_until(lambda: _has(page, last, rounds[-1].committed_at), 5, "last commit")
        for r in rounds:  # each commit was told after it happened
            told = [t for t, c in page.heard if c == Change("job", job["id"])]
            assert any(t >= r.committed_at for t in told), (r.round, told)

        before_leaving = time.time()
        await s.fleet.stop_agents()
        await wait_until(lambda: _devices_offline(s), 30, "agents gone")
        await wait_until(
            lambda: _has(page, Change("devices"), before_leaving), 10, "departure heard"
        )

        started = time.monotonic()
        await s.server.stop(grace_s=5.0)
        await asyncio.wait_for(page.ended.wait(), 5)
        assert time.monotonic() - started < 3.0, "stop waited on the streams"
        for writer in stuck:
            writer.close()
        await page.close()


async def _subscribers(s: HttpServer, n: int) -> bool:
    return s.server.feed.subscribers >= n  # the pages' streams and the app's own watcher


async def _has(page: Listener, change: Change, since: float = 0.0) -> bool:
    return change in page.kinds(since)


async def _devices_offline(s: HttpServer) -> bool:
    devices = (await s.get("/api/v1/devices"))["devices"]
    return bool(devices) and all(d["state"] == "offline" for d in devices)


async def test_a_subscriber_that_never_reads_costs_the_feed_nothing() -> None:
    """``emit`` runs inside rounds and polls: with a thousand subscribers that stopped
    reading, a hundred thousand events still take well under a second, and what each
    holds stays one entry per distinct change."""
    feed = LiveFeed(min_interval_s=0.0)
    readers = [feed.changes() for _ in range(1000)]
    first = [asyncio.ensure_future(anext(stream)) for stream in readers]
    await asyncio.sleep(0)  # each has subscribed
    assert feed.subscribers == 1000
    feed.tell(Change("devices"))
    await asyncio.gather(*first)  # each read one change, and never reads again
    started = time.perf_counter()
    for i in range(100_000):
        feed.tell(Change("job", f"job-{i % 5}"))
        feed.tell(Change("devices"))
    assert time.perf_counter() - started < 5.0
    for stream in readers[:3]:
        assert sorted(await _pending(stream), key=str) == sorted(_distinct(), key=str)
    feed.close()
    for stream in readers:
        await stream.aclose()  # type: ignore[attr-defined]
    assert feed.subscribers == 0


def _distinct() -> list[Change]:
    return [Change("devices"), *(Change("job", f"job-{i}") for i in range(5))]


async def _pending(stream: AsyncIterator[Change]) -> list[Change]:
    """What a subscriber holds, taken without waiting for more (which ends its stream)."""
    out = []
    while True:
        try:
            out.append(await asyncio.wait_for(anext(stream), 0.05))
        except (asyncio.TimeoutError, StopAsyncIteration):
            return out
