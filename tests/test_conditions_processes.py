"""Device conditions end to end: a real server, real ``flotilla client --conditions FILE``
agents, the operator's ``devices list --json``. The file is edited while the agents run."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.processes import AgentFleet, ServerProcess
from tests.support.slow_task import SLOW_DIGITS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


def _conditions(path: Path, charging: bool) -> None:
    """Write atomically, as a device manager should: the agent never reads half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"charging": charging, "battery": 0.6, "network": "unmetered"}))
    os.replace(tmp, path)


def _devices(server: ServerProcess, *args: str) -> dict[str, dict]:
    out = server.operator("devices", "list", "--json", *args).stdout
    return {d["id"]: d for d in json.loads(out)}


def _wait(server: ServerProcess, what: str, done: object, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        devices = _devices(server)
        if done(devices):  # type: ignore[operator]
            return devices
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout}s: {devices}\n{server.log.read_text()[-3000:]}")


def test_agents_follow_their_conditions_files(
    server: ServerProcess, fleet: AgentFleet, digits_spec: Path, tmp_path: Path
) -> None:
    plugged, unplugged = tmp_path / "plugged.json", tmp_path / "unplugged.json"
    _conditions(plugged, True)
    _conditions(unplugged, False)
    fleet.start(1, task=SLOW_DIGITS, extra=("--conditions", str(plugged), "--device-class", "sbc"))
    _wait(server, "the first agent", lambda d: len(d) == 1)
    fleet.start(1, task=SLOW_DIGITS, extra=("--conditions", str(unplugged)))
    devices = _wait(
        server, "two agents idle", lambda d: sum(x["state"] == "idle" for x in d.values()) == 2
    )
    first = next(i for i, d in devices.items() if d["device_class"] == "sbc")
    second = next(i for i in devices if i != first)
    assert devices[second]["conditions"]["charging"] is False

    job_id = server.submit(
        digits_spec,
        f'job.task="{SLOW_DIGITS}"',
        "job.rounds=1",
        "job.clients_per_round=1",
        "job.min_quorum=1",
        "train.params.sleep_s=9.0",  # longer than the agent's 5 s heartbeat
        "eligibility.require_charging=true",
    )
    _wait(server, "the plugged agent busy", lambda d: d[first]["state"] == "busy")
    listed = _devices(server, "--job", job_id)
    assert (listed[second]["state"], listed[second]["reason"]) == ("ineligible", "not charging")

    _conditions(plugged, False)  # unplugged mid-round: its next heartbeat gives the round up
    devices = _wait(
        server, "the unplugged agent ineligible", lambda d: d[first]["state"] == "ineligible"
    )
    assert devices[first]["ineligible"] == {job_id: "not charging"}
    assert server.status(job_id)["state"] == "running", "a dropout does not fail the job"
    _conditions(unplugged, True)  # the other one plugged in takes the retried round
    status = server.wait_for(job_id, timeout=90)
    assert status["state"] == "completed", status
    rounds = server.status(job_id, rounds=True)["rounds"]
    assert [d["device_id"] for d in rounds[0]["devices"]] == [second]
    token = (server.state_dir / "operator.token").read_text().strip()
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}/metrics",
        headers={"Authorization": f"Bearer {token}"},
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        metrics = r.read().decode()
    assert f'flotilla_device_failures_total{{job="{job_id}",reason="conditions"}} 1.0' in metrics


def test_the_devices_page_runs_as_written(tmp_path: Path) -> None:
    from tests.support.docrun import REPO, run_page

    run = run_page(REPO / "docs" / "devices.md", tmp_path, block_timeout=120)
    assert run.returncode == 0 and run.timed_out_block is None, run.output[-3000:]
    assert '"reason": "not charging"' in run.output, run.output[-3000:]
    assert '"device_class": "laptop"' in run.output
