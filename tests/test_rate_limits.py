"""Rate limits and caps: a device that floods polls, enrolments or uploads is told to wait
(gRPC RESOURCE_EXHAUSTED, HTTP 429 with Retry-After) while every other device is answered
as promptly as before; an address over its connection (HTTP) or calls-in-flight (gRPC) cap
is refused, and is served again once it holds fewer."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from flotilla.core.errors import RateLimited, Unreachable
from flotilla.core.timeouts import Timeouts
from flotilla.core.work import DeviceCredential
from flotilla.mobile.lite.http import HttpDevice, error_for
from flotilla.proto import flotilla_pb2 as pb
from flotilla.server.federation.ratelimit import ConcurrencyCap, RateLimiter, RateLimits
from flotilla.server.grpc.limits import peer_address
from tests.support.live_grpc import Device, LiveServer, live_server, refused

pytestmark = pytest.mark.timeout(60)

LIMITS = RateLimits(
    polls_per_s=1.0, poll_burst=3, enrols_per_s=0.5, enrol_burst=4, uploads_per_s=1.0,
    upload_burst=2, http_connections_per_address=3, grpc_calls_per_address=4,
)  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_allows_its_burst_then_its_rate_per_key() -> None:
    clock = Clock()
    limiter = RateLimiter(LIMITS, clock)
    for _ in range(3):
        limiter.take("poll", "a")
    with pytest.raises(RateLimited, match="too many polls") as info:
        limiter.take("poll", "a")
    assert info.value.retry_after_s == pytest.approx(1.0)
    limiter.take("poll", "b")  # another device: its own bucket
    limiter.take("upload", "a")  # another kind: its own bucket
    clock.now += 1.0
    limiter.take("poll", "a")  # one more after a second
    with pytest.raises(RateLimited):
        limiter.take("poll", "a")
    clock.now += 100.0
    for _ in range(3):  # refilled to the burst, no further
        limiter.take("poll", "a")
    with pytest.raises(RateLimited):
        limiter.take("poll", "a")


def test_buckets_stay_bounded_whatever_the_number_of_callers() -> None:
    clock = Clock()
    limiter = RateLimiter(RateLimits(max_keys=100), clock)
    for i in range(1000):
        limiter.take("poll", f"dev-{i}")
        clock.now += 0.001
    assert len(limiter) <= 100


def test_a_cap_counts_each_key_apart() -> None:
    cap = ConcurrencyCap(2)
    assert cap.enter("a") and cap.enter("a") and not cap.enter("a") and cap.enter("b")
    cap.leave("a")
    assert cap.enter("a") and cap.held("a") == 2
    assert peer_address("ipv4:127.0.0.1:5555") == "ipv4:127.0.0.1"
    assert peer_address("ipv6:[::1]:5555") == "ipv6:[::1]"


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError):
        RateLimits(polls_per_s=0)
    with pytest.raises(ValueError):
        RateLimits(grpc_calls_per_address=0)


def test_a_429_reads_as_rate_limited_with_its_wait() -> None:
    body = {"error": {"code": "rate_limited", "message": "rate limited: too many polls"}}
    error = error_for(429, body, 7.0)
    assert isinstance(error, RateLimited) and isinstance(error, Unreachable)
    assert error.retry_after_s == 7.0


@pytest.fixture
async def live(tmp_path: Path) -> AsyncIterator[LiveServer]:
    async with live_server(
        tmp_path / "state",
        rate_limits=LIMITS,
        http_port=0,
        timeouts=Timeouts(liveness_s=30.0, poll_hold_s=0.3),
    ) as srv:
        yield srv


async def _poll(live: LiveServer, device: Device) -> pb.PollReply:
    return await live.agent.Poll(pb.PollRequest(), metadata=device.md, timeout=10)


async def test_a_flooding_grpc_device_is_throttled_and_another_is_not(live: LiveServer) -> None:
    flood, calm = await live.enrol(), await live.enrol()
    results = await asyncio.gather(*(_poll(live, flood) for _ in range(4)), return_exceptions=True)
    limited = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(limited) >= 1, results
    assert limited[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "rate limited" in (limited[0].details() or "")
    assert ("retry-after", "1") in tuple(limited[0].trailing_metadata() or ())
    await refused(_poll(live, flood), grpc.StatusCode.RESOURCE_EXHAUSTED, "too many polls")
    started = time.monotonic()
    await _poll(live, calm)  # answered after its hold, as ever
    assert time.monotonic() - started < 2.0


async def test_enrolments_are_limited_per_address(live: LiveServer) -> None:
    for _ in range(4):
        await live.enrol()
    await refused(live.enrol(), grpc.StatusCode.RESOURCE_EXHAUSTED, "enrolments from this address")
    assert len(await live.store.list_devices()) == 4


async def test_grpc_calls_in_flight_are_capped_per_address(live: LiveServer) -> None:
    devices = [await live.enrol() for _ in range(4)]
    held = [asyncio.ensure_future(_poll(live, d)) for d in devices]  # four long polls
    await asyncio.sleep(0.1)
    extra = live.agent.Heartbeat(pb.HeartbeatRequest(), metadata=devices[0].md, timeout=10)
    await refused(extra, grpc.StatusCode.RESOURCE_EXHAUSTED, "calls in flight")
    await asyncio.gather(*held)
    reply = await live.agent.Heartbeat(pb.HeartbeatRequest(), metadata=devices[0].md, timeout=10)
    assert not reply.round_open  # served again once the polls returned


async def test_a_flooding_http_device_gets_429_and_another_is_not_slowed(
    live: LiveServer,
) -> None:
    port = live.server.http_port
    flood, calm = await live.enrol(), await live.enrol()

    def poll(device: Device) -> tuple[int, str | None, dict[str, object]]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            auth = f"Bearer {device.device_id}:{device.credential}"
            conn.request("POST", "/device/v1/poll", body=b"{}", headers={
                "Authorization": auth, "Content-Type": "application/json"})  # fmt: skip
            answer = conn.getresponse()
            return answer.status, answer.getheader("Retry-After"), json.loads(answer.read())
        finally:
            conn.close()

    statuses = await asyncio.gather(*(asyncio.to_thread(poll, flood) for _ in range(6)))
    limited = [(after, body) for status, after, body in statuses if status == 429]
    assert len(limited) >= 2 and all(s in (200, 429) for s, _, _ in statuses), statuses
    retry_after, body = limited[0]
    assert retry_after == "1" and body["error"]["code"] == "rate_limited"  # type: ignore[index]
    started = time.monotonic()
    assert (await asyncio.to_thread(poll, calm))[0] == 200
    assert time.monotonic() - started < 2.0
    lite = HttpDevice(f"http://127.0.0.1:{port}", retries=0)
    lite.credential = DeviceCredential(flood.device_id, flood.credential)
    with pytest.raises(RateLimited):  # the lite client reads it as such
        for _ in range(5):
            await asyncio.to_thread(lite.poll)


async def test_http_connections_are_capped_per_address(live: LiveServer) -> None:
    port = live.server.http_port or 0

    def request(sock: socket.socket) -> bytes:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        return sock.recv(4096)

    def scenario() -> None:
        held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
        try:
            assert all(b" 429 " not in request(s) for s in held)
            with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
                answer = request(extra)
                assert answer.startswith(b"HTTP/1.1 429"), answer
                assert b"connections open" in answer and b"Retry-After: 1" in answer
            held.pop().close()
            time.sleep(0.2)
            with socket.create_connection(("127.0.0.1", port), timeout=10) as again:
                assert b" 429 " not in request(again)
        finally:
            for s in held:
                s.close()

    await asyncio.to_thread(scenario)


async def test_uploads_are_limited_per_device(live: LiveServer) -> None:
    """Counted at the reservation, before the round is even looked at."""
    flood, calm = await live.enrol(), await live.enrol()
    request = pb.ReserveUploadRequest(job_id="j", round=1, round_token="t", payload_size=10)

    def reserve(device: Device) -> Any:
        return live.agent.ReserveUpload(request, metadata=device.md, timeout=10)

    for _ in range(2):  # the burst: each refused on its merits (no such round)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await reserve(flood)
        assert info.value.code() != grpc.StatusCode.RESOURCE_EXHAUSTED
    await refused(reserve(flood), grpc.StatusCode.RESOURCE_EXHAUSTED, "too many uploads")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await reserve(calm)
    assert info.value.code() != grpc.StatusCode.RESOURCE_EXHAUSTED
