"""``curl`` alone takes part in a round by following docs/protocol.md: enrol, poll, fetch
the model (half, then the rest with ``Range``), upload an update in two chunks sent out of
order, finalize; the round commits with that device. Every JSON body sent and received
validates against the protocol's JSON Schemas, and every answer carries the version."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from flotilla.core.identity import DeviceIdentity
from tests.support.device_http import small_update
from tests.support.device_schemas import check, schema_names
from tests.support.http_server import HttpServer, http_server, quick_toml, wait_until
from tests.support.lifetime import bound

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl binary"),
]

DIGITS = "flotilla.tasks.digits:DigitsTask"


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: Any


@dataclass
class Curl:
    """Runs the curl binary as docs/protocol.md shows, checking each message's schema."""

    base: str
    work: Path
    auth: str = ""
    #: The device's key: curl carries its signatures, it cannot make them (nor can a
    #: shell without a binary-safe printf); docs/identity.md shows the statement.
    identity: DeviceIdentity = field(default_factory=DeviceIdentity.generate)

    async def run(self, *args: str, out: Path | None = None) -> Answer:
        head, body = self.work / "headers.txt", out or self.work / "body.json"
        argv = ["curl", "-sS", "--max-time", "30", "-D", str(head), "-o", str(body)]
        argv += ["-w", "%{http_code}", *args]
        if self.auth:
            argv += ["-H", f"Authorization: Bearer {self.auth}"]
        proc = await asyncio.create_subprocess_exec(
            *bound(argv), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 40)
        assert proc.returncode == 0, stderr.decode()
        headers = {}
        for line in head.read_text().splitlines()[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        payload: Any = body.read_bytes() if out else json.loads(body.read_text() or "null")
        assert headers.get("flotilla-protocol") == "1", headers
        return Answer(int(stdout), headers, payload)

    async def json(self, method: str, path: str, request: str, body: Any, reply: str) -> Any:
        if request:
            check(request, body)
        answer = await self.run(
            "-X", method, self.base + path, "-H", "Content-Type: application/json",
            "--data-binary", json.dumps(body),
        )  # fmt: skip
        check(reply if answer.status < 400 else "error", answer.body)
        assert answer.status < 400, answer
        return answer.body


async def _poll_until_task(curl: Curl, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    body = {"conditions": {"charging": True, "battery": 0.9, "network": "unmetered"}}
    while time.monotonic() < deadline:
        reply = await curl.json("POST", "/poll", "poll-request", body, "poll-response")
        if reply["task"] is not None and reply["task"]["job_id"] == job_id:
            return dict(reply["task"])
    raise AssertionError("curl was never offered a task")


async def _fetch_in_two_parts(curl: Curl, task: dict[str, Any], dest: Path) -> bytes:
    url = curl.base + task["model_url"].removeprefix("/device/v1")
    half = task["model_size"] // 2
    first = await curl.run("-H", f"Range: bytes=0-{half - 1}", url, out=dest)
    assert first.status == 206 and first.headers["content-range"].startswith(f"bytes 0-{half - 1}/")
    assert first.headers["etag"] == f'"{task["model_sha256"]}"'
    rest = await curl.run("-C", "-", url, out=dest)  # curl resumes with Range: bytes=HALF-
    assert rest.status == 206, rest.headers
    data = dest.read_bytes()
    assert hashlib.sha256(data).hexdigest() == task["model_sha256"]
    return data


async def _upload(curl: Curl, task: dict[str, Any], update: bytes) -> None:
    ask = {
        "job_id": task["job_id"], "round": task["round"], "round_token": task["round_token"],
        "size": len(update), "sha256": hashlib.sha256(update).hexdigest(),
        "codec": "", "num_samples": 9, "metrics": {"loss": 0.5},
    }  # fmt: skip
    signed = curl.identity.sign_update(
        task["job_id"], task["round"], task["round_token"], hashlib.sha256(update).digest()
    )
    ask.update(nonce=signed.nonce.hex(), signature=signed.signature.hex())
    made = await curl.json("POST", "/uploads", "upload-request", ask, "upload-response")
    assert made["missing"] == [[0, len(update) - 1]]
    path = f"/uploads/{made['upload_id']}"
    cut = len(update) // 2
    for start, end in ((cut, len(update)), (0, cut)):  # out of order, as a resume may
        chunk = curl.work / "chunk.bin"
        chunk.write_bytes(update[start:end])
        answer = await curl.run(
            "-X", "PUT", curl.base + path, "--data-binary", f"@{chunk}",
            "-H", "Content-Type: application/octet-stream",
            "-H", f"Content-Range: bytes {start}-{end - 1}/{len(update)}",
        )  # fmt: skip
        assert answer.status == 200, answer
        check("upload-response", answer.body)
    status = await curl.run(curl.base + path)
    check("upload-response", status.body)
    assert status.body["missing"] == [] and status.body["received"] == [[0, len(update) - 1]]
    done = await curl.json("POST", f"{path}/finalize", "finalize-request", {}, "finalize-response")
    assert done["accepted"] is True and done["upload"]["state"] == "accepted"


async def test_curl_alone_takes_part_in_a_round_by_following_the_protocol(
    db_url: str, tmp_path: Path
) -> None:
    async with http_server(tmp_path / "state", db_url) as s:
        curl = Curl(f"{s.base}/device/v1", tmp_path)
        enrol = {
            "protocol": 1,
            "token": await s.fleet.enrol_token(),
            "profile": {"tasks": [DIGITS]},
            "public_key": curl.identity.public_key_hex,
        }
        made = await curl.json("POST", "/enrol", "enrol-request", enrol, "enrol-response")
        curl.auth = f"{made['device_id']}:{made['credential']}"
        job = await _job(s)
        task = await _poll_until_task(curl, job)
        beat = {"round_token": task["round_token"], "conditions": {"charging": True}}
        alive = await curl.json(
            "POST", "/heartbeat", "heartbeat-request", beat, "heartbeat-response"
        )
        assert alive["round_open"] is True
        model = await _fetch_in_two_parts(curl, task, tmp_path / "model.safetensors")
        await _upload(curl, task, small_update(model))

        async def committed() -> bool:
            return (await s.fleet.status(job))["rounds_committed"] == 1

        await wait_until(committed, 30, "round 1")
        rows = await s.server.store.list_participations(job)
        assert [(p.device_id, p.num_samples) for p in rows] == [(made["device_id"], 9)]
        bye = await curl.json(
            "POST", "/leave", "leave-request", {"reason": "done"}, "leave-response"
        )
        assert bye["left"] is True


async def _job(s: HttpServer) -> str:
    status, job = await s.submit_toml(quick_toml(rounds=1, clients=1))
    assert status == 201, job
    return str(job["id"])


def test_every_schema_is_a_valid_draft_2020_12_schema() -> None:
    from jsonschema import Draft202012Validator

    from tests.support.device_schemas import SCHEMA_DIR

    for name in schema_names():
        doc = json.loads((SCHEMA_DIR / f"{name}.schema.json").read_text())
        Draft202012Validator.check_schema(doc)
        assert doc["$id"].endswith(f"/device/v1/{name}.schema.json")
