"""Garbage, oversized, truncated and replayed requests on every device endpoint: each gets
a clear 4xx JSON error (valid against the error schema, with the protocol version) and
leaves nothing in the database; afterwards the same device's good update still commits."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import create_async_engine

from flotilla.mobile.lite.http import HttpDevice
from flotilla.server.federation.schema import Base
from flotilla.server.federation.store import async_url
from tests.support.device_http import enrolled, off_loop, small_update, task_of
from tests.support.device_schemas import check
from tests.support.http_server import HttpServer, http_server, quick_toml, wait_until

pytestmark = pytest.mark.timeout(120)

DIGITS = "flotilla.tasks.digits:DigitsTask"


@dataclass
class Raw:
    """Bare requests to the device edge: exactly what a broken or hostile device sends."""

    s: HttpServer
    auth: str = ""

    async def call(
        self, method: str, path: str, data: bytes | str = b"", auth: str | None = None, **h: str
    ) -> tuple[int, Any]:
        headers = dict(h)
        bearer = self.auth if auth is None else auth
        if bearer:
            headers["Authorization"] = f"Bearer {bearer}"
        url = f"{self.s.base}/device/v1{path}"
        body = data.encode() if isinstance(data, str) else data
        async with self.s.http.request(method, url, data=body, headers=headers) as r:
            assert r.headers.get("Flotilla-Protocol") == "1", (path, r.status)
            if r.content_type == "application/json":
                return r.status, await r.json()
            return r.status, await r.read()

    async def refused(
        self, status: int, code: str, needle: str, method: str, path: str, **kw: Any
    ) -> None:
        got, body = await self.call(method, path, **kw)
        assert (got, body["error"]["code"]) == (status, code), (method, path, got, body)
        assert needle.lower() in body["error"]["message"].lower(), body
        check("error", body)


@asynccontextmanager
async def snapshots(db_url: str) -> AsyncIterator[Any]:
    engine = create_async_engine(async_url(db_url))

    async def snapshot(skip: tuple[str, ...] = ()) -> dict[str, list[tuple[Any, ...]]]:
        out = {}
        async with engine.connect() as conn:
            for table in Base.metadata.sorted_tables:
                if table.name not in skip:
                    rows = await conn.execute(select(table).order_by(*table.primary_key.columns))
                    out[table.name] = [tuple(r) for r in rows]
        return out

    try:
        yield snapshot
    finally:
        await engine.dispose()


async def test_bad_enrolments_and_polls_are_refused_clearly_and_write_nothing(
    db_url: str, tmp_path: Path
) -> None:
    async with http_server(tmp_path / "state", db_url) as s, snapshots(db_url) as snapshot:
        raw = Raw(s)
        token = await s.fleet.enrol_token()
        good = {"protocol": 1, "token": token, "profile": {"tasks": [DIGITS]}}
        before = await snapshot()
        bad_enrolments = [
            (400, "bad_request", "not valid utf-8 json", "{not json"),
            (400, "bad_request", "unknown field(s) bogus", {**good, "bogus": 1}),
            (400, "bad_request", "'tasks' must be", {**good, "profile": {"tasks": "x"}}),
            (400, "bad_request", "missing field 'profile'", {"protocol": 1, "token": token}),
            (400, "bad_request", "public key is 64", {**good, "public_key": "ab" * 31}),
            (400, "bad_request", "lowercase hex", {**good, "public_key": "AB" * 32}),
            (400, "bad_request", "protocol version 2", {**good, "protocol": 2}),
            (400, "bad_request", "expected a json object", [1, 2]),
            (401, "unauthorized", "enrolment token refused", {**good, "token": "nope"}),
            (413, "payload_too_large", "body over", {**good, "pad": "x" * 100_000}),
        ]
        for status, code, needle, body in bad_enrolments:
            data = body if isinstance(body, str) else json.dumps(body)
            await raw.refused(status, code, needle, "POST", "/enrol", data=data)
        assert await snapshot() == before, "a refused enrolment wrote nothing"

        device = await enrolled(s.base, token)
        assert device.credential is not None
        raw.auth = f"{device.credential.device_id}:{device.credential.secret}"
        await raw.refused(401, "unauthorized", "bearer", "POST", "/poll", auth="", data="{}")
        await raw.refused(401, "unauthorized", "bearer", "POST", "/poll", auth="no-colon")
        wrong = f"{device.credential.device_id}:wrong"
        await raw.refused(401, "unauthorized", "refused", "POST", "/poll", auth=wrong)
        for body, needle in (
            ({"conditions": {"battery": 2}}, "battery must be within 0..1"),
            ({"conditions": {"plugged": True}}, "unknown field(s) plugged"),
            ({"conditions": {"charging": "yes"}}, "charging must be true, false or null"),
            ({"profile": {"tasks": []}}, "'tasks' must be"),
            ({"wait": 3}, "unknown field(s) wait"),
        ):
            await raw.refused(400, "bad_request", needle, "POST", "/poll", data=json.dumps(body))
        await raw.refused(400, "bad_request", "missing field 'round_token'", "POST", "/heartbeat")
        await raw.refused(400, "bad_request", "64 lowercase hex", "GET", "/models/abc")
        await raw.refused(410, "stale_round", "not assigned", "GET", "/models/" + "0" * 64)
        await raw.refused(404, "not_found", "no device route", "GET", "/nothing/here")
        ref = {"job_id": "job-x", "round": 1, "round_token": "t", "reason": "unplugged"}
        await raw.refused(410, "stale_round", "not open", "POST", "/failure", data=json.dumps(ref))
        await raw.refused(404, "not_found", "no upload", "GET", "/uploads/up-nope")
        assert await snapshot(skip=("devices",)) == {
            k: v for k, v in before.items() if k != "devices"
        }


async def test_bad_uploads_are_refused_and_the_good_one_still_commits_once(
    db_url: str, tmp_path: Path
) -> None:
    async with http_server(tmp_path / "state", db_url) as s, snapshots(db_url) as snapshot:
        device = await enrolled(s.base, await s.fleet.enrol_token())
        assert device.credential is not None
        raw = Raw(s, f"{device.credential.device_id}:{device.credential.secret}")
        status, job = await s.submit_toml(quick_toml(rounds=1, clients=1))
        assert status == 201, job
        task = await task_of(device, job["id"])
        model = await off_loop(device.download_model, task.order, tmp_path / "model.st")
        update = small_update(model.path.read_bytes())
        await _bad_model_ranges(raw, task.order.model_sha256, task.order.model_size)
        # Refusals are recorded (the ``refusals`` table, the operator's audit trail); no
        # other table may change.
        before = await snapshot(skip=("devices", "refusals"))

        order = task.order
        ask = {
            "job_id": order.job_id, "round": order.round, "round_token": order.round_token,
            "size": len(update), "sha256": hashlib.sha256(update).hexdigest(),
            "num_samples": 3,
        }  # fmt: skip
        for body, status_code, needle in (
            ({**ask, "round_token": "old"}, (410, "stale_round"), "not open"),
            ({**ask, "round": 0}, (400, "bad_request"), "'round' must be an integer >= 1"),
            ({**ask, "sha256": "XYZ"}, (400, "bad_request"), "64 lowercase hex"),
            ({**ask, "size": 10**12}, (413, "payload_too_large"), "exceeds the limit"),
            ({**ask, "metrics": {"loss": "low"}}, (400, "bad_request"), "must be a number"),
        ):
            await raw.refused(*status_code, needle, "POST", "/uploads", data=json.dumps(body))

        await _chunks_replays_and_conflicts(raw, ask, update)
        # A wrong checksum and undecodable bytes are refused at finalize; the device keeps
        # its place in the round.
        await _finalize_refused(raw, {**ask, "sha256": "0" * 64}, update, 422, "integrity")
        junk = b"\x00" * len(update)
        junk_ask = _signed(device, {**ask, "sha256": hashlib.sha256(junk).hexdigest()})
        await _finalize_refused(raw, junk_ask, junk, 400, "bad_request")
        assert await snapshot(skip=("devices", "refusals")) == before, "refusals committed nothing"

        sent = await off_loop(device.upload, task.order, update, 3)
        assert sent.accepted

        async def committed() -> bool:
            return (await s.fleet.status(job["id"]))["rounds_committed"] == 1

        await wait_until(committed, 30, "round 1")
        rows = await s.server.store.list_participations(job["id"])
        assert [(p.device_id, p.num_samples) for p in rows] == [(device.credential.device_id, 3)]
        path = f"/uploads/{sent.upload_id}"
        await raw.refused(409, "already_finalized", "accepted", "POST", f"{path}/finalize")
        headers = {"Content-Range": f"bytes 0-9/{len(update)}"}
        await raw.refused(410, "gone", "takes no chunks", "PUT", path, data=update[:10], **headers)
        assert len(await s.server.store.list_participations(job["id"])) == 1


def _signed(device: HttpDevice, ask: dict[str, Any]) -> dict[str, Any]:
    assert device.identity is not None
    signed = device.identity.sign_update(
        ask["job_id"], ask["round"], ask["round_token"], bytes.fromhex(ask["sha256"])
    )
    return {**ask, "nonce": signed.nonce.hex(), "signature": signed.signature.hex()}


async def _bad_model_ranges(raw: Raw, sha: str, size: int) -> None:
    path = f"/models/{sha}"
    await raw.refused(416, "range_not_satisfiable", f"has {size} bytes", "GET", path,
                      Range=f"bytes={size}-")  # fmt: skip
    await raw.refused(400, "bad_request", "one byte range", "GET", path, Range="bytes=0-1,4-5")
    status, body = await raw.call("GET", path, **{"If-None-Match": f'"{sha}"'})
    assert status == 304 and body == b""
    status, body = await raw.call("GET", path, Range="bytes=-10")
    assert status == 206 and len(body) == 10


async def _create(raw: Raw, ask: dict[str, Any]) -> str:
    status, made = await raw.call("POST", "/uploads", data=json.dumps(ask))
    assert status == 201, made
    check("upload-response", made)
    return str(made["upload_id"])


async def _chunks_replays_and_conflicts(raw: Raw, ask: dict[str, Any], update: bytes) -> None:
    path = f"/uploads/{await _create(raw, ask)}"
    size = len(update)

    async def put(start: int, data: bytes, **h: str) -> tuple[int, Any]:
        headers = {"Content-Range": f"bytes {start}-{start + len(data) - 1}/{size}", **h}
        return await raw.call("PUT", path, data=data, **headers)

    await raw.refused(400, "bad_request", "content-range must be", "PUT", path, data=b"abc")
    bad_total = {"Content-Range": f"bytes 0-2/{size + 1}"}
    await raw.refused(400, "bad_request", "declared size", "PUT", path, data=b"abc", **bad_total)
    short = {"Content-Range": f"bytes 0-9/{size}"}
    await raw.refused(400, "bad_request", "not the 10 bytes", "PUT", path, data=b"abc", **short)
    assert (await put(0, update[:100]))[0] == 200
    assert (await put(0, update[:100]))[0] == 200, "a resent chunk is harmless"
    status, body = await put(50, b"\xff" * 100)
    assert (status, body["error"]["code"]) == (409, "conflict"), body
    await _truncated_chunk(raw, path, size)
    status, body = await raw.call("GET", path)
    assert body["received"] == [[0, 99]] and body["missing"] == [[100, size - 1]], body
    await raw.refused(409, "incomplete", "missing", "POST", f"{path}/finalize")


async def _truncated_chunk(raw: Raw, path: str, size: int) -> None:
    """Headers promise 1000 bytes, 500 come, then the connection ends: none of it is kept
    (aiohttp closes a half-closed connection without an answer; a 400 would name it)."""
    host, port = "127.0.0.1", raw.s.server.http_port
    reader, writer = await asyncio.open_connection(host, port)
    head = (
        f"PUT /device/v1{path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {raw.auth}\r\n"
        f"Content-Range: bytes 1000-1999/{size}\r\nContent-Length: 1000\r\n\r\n"
    )
    writer.write(head.encode() + b"\x01" * 500)
    await writer.drain()
    writer.write_eof()
    answer = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    assert answer == b"" or (answer.startswith(b"HTTP/1.1 400") and b"truncated" in answer), answer


async def _finalize_refused(
    raw: Raw, ask: dict[str, Any], data: bytes, status: int, code: str
) -> None:
    path = f"/uploads/{await _create(raw, ask)}"
    headers = {"Content-Range": f"bytes 0-{len(data) - 1}/{len(data)}"}
    got, body = await raw.call("PUT", path, data=data, **headers)
    assert got == 200, body
    await raw.refused(status, code, "", "POST", f"{path}/finalize")
    got, body = await raw.call("GET", path)
    assert body["state"] == "refused", body
    await raw.refused(409, "already_finalized", "refused", "POST", f"{path}/finalize")
