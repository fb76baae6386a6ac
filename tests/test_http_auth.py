"""Every route of the OpenAPI document refuses a missing or wrong token (401) and a read
token on a write (403), and takes the tokens it should; tokens are compared in constant
time and never logged; read tokens and enrolment tokens do not stand in for each other."""

from __future__ import annotations

import logging
from pathlib import Path

import aiohttp
import pytest

from flotilla.core.access import Scope
from flotilla.core.device import DeviceProfile
from flotilla.core.errors import AuthError
from flotilla.server.federation import auth
from flotilla.server.http.openapi import OPERATIONS, Operation
from tests.support.hand_device import HandDevice
from tests.support.http_server import HttpServer, http_server, quick_toml
from tests.support.inproc import DIGITS
from tests.support.live_grpc import run_cli

pytestmark = pytest.mark.timeout(120)


async def _call(
    s: HttpServer, op: Operation, token: str | None, job_id: str, device_id: str = ""
) -> int:
    """The status of one call of ``op`` (a server-sent event stream is closed at once)."""
    path = op.path.replace("{id}", device_id if "/devices/" in op.path else job_id)
    data = quick_toml(name="walked").encode() if op.body else None
    headers = s.headers(token)
    async with s.http.request(op.method, s.base + path, headers=headers, data=data) as r:
        if r.status >= 400:
            body = await r.json()
            assert body["error"]["message"], body
            expected = {401: "unauthorized", 403: "forbidden"}.get(r.status)
            assert expected is None or body["error"]["code"] == expected, body
        return r.status


async def test_every_route_wants_the_right_token(db_url: str, tmp_path: Path) -> None:
    async with http_server(tmp_path / "state", db_url) as s:
        _, job = await s.submit_toml(quick_toml())
        job_id = job["id"]
        enrol = await s.fleet.enrol_token()
        assert {op.scope for op in OPERATIONS} == {None, Scope.READ, Scope.OPERATOR}
        device_id = (await HandDevice.enrol(s.fleet)).record.id
        for op in OPERATIONS:
            label = f"{op.method.upper()} {op.path}"
            if op.scope is None:
                assert await _call(s, op, None, job_id) == op.ok[0], label
                continue
            for wrong in (None, "not-a-token", enrol, s.read_token + "x"):
                assert await _call(s, op, wrong, job_id, device_id) == 401, (label, wrong)
            read = await _call(s, op, s.read_token, job_id, device_id)
            assert read == (op.ok[0] if op.scope is Scope.READ else 403), label
            assert await _call(s, op, s.operator_token, job_id, device_id) == op.ok[0], label
        record = await s.server.store.get_job(job_id)
        assert record is not None and record.state == "cancelled"  # the operator's cancel
        names = [j["name"] for j in (await s.get("/api/v1/jobs"))["jobs"]]
        assert names == ["quick", "walked"]  # the operator's submit; the read token's: 403


async def test_tokens_are_compared_in_constant_time_and_never_logged(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    compared: list[tuple[str, str]] = []
    real = auth.hmac.compare_digest

    def spy(a: str, b: str) -> bool:
        compared.append((a, b))
        return real(a, b)

    async with http_server(tmp_path / "state", db_url) as s:
        await s.get("/api/v1/jobs")  # the read token, seen once: remembered by its hash
        monkeypatch.setattr(auth.hmac, "compare_digest", spy)
        caplog.set_level(logging.DEBUG)
        await s.get("/api/v1/jobs?token=" + s.operator_token)
        status, _ = await s.call("GET", "/api/v1/devices", "wrong-" + s.read_token)
        assert status == 401
        assert (auth.hash_secret(s.read_token), auth.hash_secret(s.read_token)) in compared
        async with s.http.get(f"{s.base}/healthz?x={s.read_token}") as r:
            assert r.status == 200
    lines = caplog.text
    assert "GET /api/v1/jobs 200" in lines  # the access log has the path, not the query
    for secret in (s.read_token, s.operator_token):
        assert secret not in lines


async def test_read_tokens_from_the_cli_read_and_cannot_enrol(db_url: str, tmp_path: Path) -> None:
    state = tmp_path / "state"
    async with http_server(state, db_url) as s:
        minted = await run_cli(
            "server", "token", "create", "--read-only", "--state-dir", str(state)
        )
        assert minted.returncode == 0, minted.stderr
        token = minted.stdout.strip().splitlines()[-1]
        headers = {"Authorization": f"Bearer {token}"}
        async with s.http.get(f"{s.base}/api/v1/whoami", headers=headers) as r:
            assert await r.json() == {"scope": "read", "source": "server"}
        async with s.http.post(f"{s.base}/api/v1/jobs", headers=headers, data=b"x") as r:
            assert r.status == 403
        with pytest.raises(AuthError):
            await s.server.federation.enrol(token, DeviceProfile("", tasks=(DIGITS,)))

        enrol = await run_cli("server", "token", "create", "--state-dir", str(state))
        enrol_token = enrol.stdout.strip().splitlines()[-1]
        credential = await s.server.federation.enrol(
            enrol_token, DeviceProfile("", tasks=(DIGITS,))
        )
        assert credential.device_id
        for bearer in (enrol_token, credential.secret):
            async with s.http.get(
                f"{s.base}/api/v1/jobs", headers={"Authorization": f"Bearer {bearer}"}
            ) as r:
                assert r.status == 401
        async with aiohttp.ClientSession() as plain, plain.get(f"{s.base}/metrics") as r:
            assert r.status == 401  # no Authorization header at all
