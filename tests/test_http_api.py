"""The HTTP API over a running federation: a job submitted as TOML runs on real agents, and
every read route answers with the shapes of docs/http-api.md, agreeing with what the CLI's
``--json`` prints and what the store recorded."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.numpy import load as load_safetensors

from flotilla.server.http.openapi import document
from tests.support.http_server import HttpServer, http_server, quick_toml, wait_until

pytestmark = pytest.mark.timeout(240)

JOB_FIELDS = {
    "id", "name", "state", "task", "rounds_committed", "rounds_total", "metrics",
    "created_at", "updated_at",
}  # fmt: skip
ROUND_FIELDS = {
    "round", "metrics", "participants", "devices", "started_at", "committed_at",
    "checkpoint_sha256", "selected", "failures", "stale", "bytes_up", "bytes_down", "decisions",
}  # fmt: skip
DEVICE_FIELDS = {
    "id", "state", "job", "device_class", "tasks", "gflops", "upload_bytes_per_s", "last_seen",
    "rounds_served", "failures", "ineligible_reason", "samples",
}  # fmt: skip


async def test_a_job_submitted_as_toml_runs_and_every_read_route_shows_it(
    db_url: str, tmp_path: Path
) -> None:
    async with http_server(tmp_path / "state", db_url) as s:
        await s.fleet.start_agents(2)
        status, job = await s.submit_toml(quick_toml(rounds=3))
        assert status == 201, job
        assert set(job) == JOB_FIELDS and job["state"] == "pending" and job["name"] == "quick"
        listed = (await s.get("/api/v1/jobs"))["jobs"]
        assert [j["id"] for j in listed] == [job["id"]]
        await s.fleet.wait_for(job["id"], timeout=180)

        await _check_job(s, job["id"])
        await _check_rounds(s, job["id"])
        await _check_devices(s)
        await _check_model_and_metrics(s, job["id"])
        assert await s.get("/api/v1/volunteer-runs") == {"volunteer_runs": []}
        assert await s.get("/api/v1/whoami", "operator") == {
            "scope": "operator",
            "source": "server",
        }
        assert await s.get("/openapi.json", None) == document()
        assert await s.get("/healthz", None) == {"status": "ok"}
        assert await s.get("/readyz", None) == {"status": "ready"}
        await wait_until(lambda: _history_shows_both(s), 10, "both agents in the history")
        for path in ("", "/rounds", "/model"):
            status, body = await s.call("GET", f"/api/v1/jobs/job-nope{path}", "read")
            assert (status, body["error"]["code"]) == (404, "not_found"), path
            assert "job-nope" in body["error"]["message"]


async def _history_shows_both(s: HttpServer) -> bool:
    """The device history's samples are well formed, and one saw both agents online (it
    samples at most once a second, so a fast job may end before the second sample)."""
    samples = (await s.get("/api/v1/devices/history"))["samples"]
    assert samples and all(set(x) == {"t", "idle", "busy", "offline"} for x in samples)
    return max(x["idle"] + x["busy"] for x in samples) == 2


async def _check_job(s: HttpServer, job_id: str) -> None:
    """The job as ``job status --json`` prints it, plus ``updated_at``."""
    api = await s.get(f"/api/v1/jobs/{job_id}")
    cli = await s.fleet.status(job_id)
    assert set(api) == JOB_FIELDS
    assert {k: api[k] for k in cli} == cli
    assert api["state"] == "completed" and api["rounds_committed"] == 3
    assert 0.0 <= api["metrics"]["accuracy"] <= 1.0
    assert (await s.get("/api/v1/jobs"))["jobs"] == [api]


async def _check_rounds(s: HttpServer, job_id: str) -> None:
    """Rounds as ``job status --json --rounds`` prints them, with their accounts."""
    rounds = (await s.get(f"/api/v1/jobs/{job_id}/rounds"))["rounds"]
    cli = (await s.fleet.status(job_id, rounds=True))["rounds"]
    records = await s.server.store.list_rounds(job_id)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    for api, printed, record in zip(rounds, cli, records, strict=True):
        assert set(api) == ROUND_FIELDS
        assert {k: api[k] for k in printed if k != "devices"} == {
            k: v for k, v in printed.items() if k != "devices"
        }
        for device, shown in zip(api["devices"], printed["devices"], strict=True):
            assert {k: device[k] for k in shown} == shown
            assert device["device_class"]
        assert api["selected"] == list(record.account.selected)
        assert set(api["participants"]) <= set(api["selected"])
        assert api["bytes_up"] == record.account.bytes_up > 0
        assert api["bytes_down"] == record.account.bytes_down > 0
        assert api["decisions"] == list(record.account.decisions) and api["decisions"]
        assert api["started_at"] <= api["committed_at"]
    later = (await s.get(f"/api/v1/jobs/{job_id}/rounds?since=2"))["rounds"]
    assert later == rounds[2:]
    assert (await s.get(f"/api/v1/jobs/{job_id}/rounds?since=3"))["rounds"] == []
    status, body = await s.call("GET", f"/api/v1/jobs/{job_id}/rounds?since=-1", "read")
    assert (status, body["error"]["code"]) == (400, "bad_request")


async def _check_devices(s: HttpServer) -> None:
    devices = (await s.get("/api/v1/devices"))["devices"]
    cli = {d["id"]: d for d in await s.fleet.devices()}
    assert {d["id"] for d in devices} == set(cli) and len(devices) == 2
    for d in devices:
        assert set(d) == DEVICE_FIELDS
        assert d["state"] == cli[d["id"]]["state"] == "idle"
        assert d["job"] == ""
        assert d["rounds_served"] == 3  # two agents, two per round: each served all three
        assert d["device_class"] in ("light", "cpu", "accelerated")
        assert d["failures"] == {} and d["last_seen"] > 0
        # Counted when its first round loaded its shard, reported with the next poll.
        assert d["samples"] == cli[d["id"]]["samples"]
        assert list(d["samples"]) == d["tasks"] and min(d["samples"].values()) > 0


async def _check_model_and_metrics(s: HttpServer, job_id: str) -> None:
    status, model = await s.call("GET", f"/api/v1/jobs/{job_id}/model", "read")
    assert status == 200
    assert model == await s.fleet.export(job_id)  # what `flotilla job export` writes
    tensors = load_safetensors(model)
    assert tensors and all(t.size > 0 for t in tensors.values())
    status, text = await s.call("GET", "/metrics", "read")
    assert status == 200
    committed = {
        sample.labels.get("job"): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
        if sample.name == "flotilla_rounds_committed_total"
    }
    assert committed == {job_id: 3.0}


async def test_submit_refuses_what_job_submit_refuses_and_cancel_cancels(
    db_url: str, tmp_path: Path
) -> None:
    """No agents: the submitted job waits for devices, so cancelling finds it running."""
    async with http_server(tmp_path / "state", db_url) as s:
        await _refusals(s)
        two = quick_toml() + '[[jobs]]\njob = { name = "a" }\n[[jobs]]\njob = { name = "b" }\n'
        status, body = await s.submit_toml(two)
        assert (status, body["error"]["code"]) == (400, "invalid_spec")
        assert "?job=NAME" in body["error"]["message"]
        status, job = await s.call("POST", "/api/v1/jobs?job=b", "operator", data=two.encode())
        assert status == 201 and job["name"] == "b"

        status, cancelled = await s.call("POST", f"/api/v1/jobs/{job['id']}/cancel", "operator")
        assert status == 200 and cancelled["id"] == job["id"]
        assert cancelled["state"] == "cancelled"
        record = await s.server.store.get_job(job["id"])
        assert record is not None and record.state == "cancelled"
        assert (await s.get(f"/api/v1/jobs/{job['id']}"))["state"] == "cancelled"
        # The list was read before: it is kept and only changed rows are read again.
        status, later = await s.call("POST", "/api/v1/jobs?job=a", "operator", data=two.encode())
        assert status == 201
        listed = (await s.get("/api/v1/jobs"))["jobs"]
        assert [j["id"] for j in listed] == [job["id"], later["id"]]
        assert listed[0] == await s.get(f"/api/v1/jobs/{job['id']}")
        assert listed[1]["state"] in ("pending", "running")  # it waits for devices
        status, body = await s.call("POST", "/api/v1/jobs/job-nope/cancel", "operator")
        assert (status, body["error"]["code"]) == (404, "not_found")


async def _refusals(s: HttpServer) -> None:
    cases: list[tuple[str, str]] = [
        ("[job\nname = 1", "not valid TOML"),
        (quick_toml() + "bogus = 1\n", "job.bogus"),
        (quick_toml().replace("rounds = 3", "rounds = 0"), "job.rounds"),
        (quick_toml().replace("DigitsTask", "NoSuchTask"), "job.task"),
        ("", "empty"),
    ]
    for toml, needle in cases:
        status, body = await s.submit_toml(toml)
        assert status == 400, (toml, body)
        assert body["error"]["code"] == "invalid_spec"
        assert needle in body["error"]["message"], (needle, body)
    status, body = await s.call("POST", "/api/v1/jobs", "operator", data=b"x" * (2 << 20))
    assert (status, body["error"]["code"]) == (413, "payload_too_large")
    status, body = await s.call("POST", "/api/v1/jobs", "operator", data=b"\xff\xfe")
    assert (status, body["error"]["code"]) == (400, "bad_request")
    assert await s.get("/api/v1/jobs") == {"jobs": []}
