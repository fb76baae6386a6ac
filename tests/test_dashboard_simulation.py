"""``flotilla dashboard DIR``'s read model follows a simulation's output directory while it
is written: rows written piece by piece by hand here, then a real ``flotilla simulate``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from flotilla.core.errors import NotFoundError
from flotilla.dashboard.model import Change
from flotilla.dashboard.simulation import SimulationSource
from flotilla.dashboard.tail import JsonlTail
from tests.support.experiments import experiment_file, rows
from tests.support.lifetime import bound

pytestmark = pytest.mark.timeout(120)


def metrics_row(round_: int, participants: list[str], **extra: Any) -> dict[str, Any]:
    failures = [{"device_id": "d9", "reason": "timeout"}]
    return {
        "job": "small", "job_id": "job-0", "round": round_, "simulated_time": 10.0 * round_,
        "round_seconds": 4.0, "accuracy": 0.1 * round_, "loss": 2.0 / round_,
        "selected": [*participants, "d9"], "failures": failures, "stale": [],
        "bytes_up": 100 * len(participants), "bytes_down": 200, "decisions": ["selected 3"],
        "participants": len(participants), "dropouts": 0, "wall_seconds": 1.5, **extra,
    }  # fmt: skip


def served(round_: int, device: str, device_class: str = "phone") -> dict[str, Any]:
    return {
        "job": "small", "round": round_, "device": device, "device_class": device_class,
        "num_samples": 20, "started_at": 10.0 * round_ - 4, "finished_at": 10.0 * round_ - 1,
        "bytes_up": 100.0, "bytes_down": 100.0,
    }  # fmt: skip


def line(row: dict[str, Any]) -> str:
    return json.dumps(row) + "\n"


def append(path: Path, text: str) -> None:
    with path.open("a") as f:
        f.write(text)


def source(directory: Path) -> SimulationSource:
    return SimulationSource(directory, poll_s=0.0)


def test_a_tail_returns_complete_lines_once_and_notices_a_rewrite(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    tail = JsonlTail(path)
    assert tail.read().rows == () and not tail.read().reset  # not there yet
    path.write_text('{"a": 1}\n{"b"')
    assert tail.read().rows == ({"a": 1},)
    assert tail.read().rows == ()  # the half line waits
    append(path, ': 2}\nnot json\n[1]\n{"c": 3}\n')
    assert tail.read().rows == ({"b": 2}, {"c": 3})  # what is not an object is skipped
    path.write_text('{"new": 1}\n')  # truncated by a new run
    again = tail.read()
    assert again.reset and again.rows == ({"new": 1},)
    path.write_text('{"NEW": 1}\n{"longer than before, same size class": 2}\n')
    assert tail.read().reset  # rewritten past the old offset: its start changed
    path.unlink()
    assert tail.read().reset


async def test_rounds_appear_once_their_participants_are_written(tmp_path: Path) -> None:
    sim = source(tmp_path)
    assert await sim.jobs() == [] and await sim.devices() == []
    declared = {"id": "job-0", "name": "small", "task": "digits", "rounds_total": 2}
    (tmp_path / "jobs.json").write_text(json.dumps({"jobs": [declared]}))
    [job] = await sim.jobs()
    assert (job.id, job.name, job.state, job.rounds_committed, job.rounds_total) == (
        "job-0", "small", "pending", 0, 2,
    )  # fmt: skip
    metrics, part = tmp_path / "metrics.jsonl", tmp_path / "participation.jsonl"
    text = line(metrics_row(1, ["d1", "d2"]))
    append(metrics, text[:30])
    assert await sim.rounds("job-0") == []
    append(metrics, text[30:])
    append(part, line(served(1, "d1")))
    assert await sim.rounds("job-0") == []  # one of its two participants is still unread
    append(part, line(served(1, "d2", "laptop"))[:-1])  # no newline yet
    assert await sim.rounds("job-0") == []
    append(part, "\n")
    [r1] = await sim.rounds("job-0")
    assert r1.round == 1 and r1.participants == ("d1", "d2")
    assert r1.metrics == {"accuracy": 0.1, "loss": 2.0}
    assert (r1.started_at, r1.committed_at) == (6.0, 10.0)
    assert r1.selected == ("d1", "d2", "d9") and r1.failures[0].reason == "timeout"
    assert (r1.bytes_up, r1.bytes_down, r1.decisions) == (200, 200, ("selected 3",))
    assert [d.device_class for d in r1.devices] == ["phone", "laptop"]
    [job] = await sim.jobs()
    assert (job.state, job.rounds_committed, job.metrics["accuracy"]) == ("running", 1, 0.1)
    devices = {d.id: d for d in await sim.devices()}
    assert set(devices) == {"d1", "d2", "d9"}
    assert devices["d1"].state == "busy" and devices["d1"].job == "job-0"
    assert devices["d9"].failures == {"timeout": 1} and devices["d9"].rounds_served == 0
    assert devices["d2"].device_class == "laptop" and devices["d2"].rounds_served == 1
    with pytest.raises(NotFoundError):
        await sim.rounds("job-7")

    append(metrics, line(metrics_row(2, ["d1"])))
    append(part, line(served(2, "d1")))
    (tmp_path / "summary.json").write_text(json.dumps({"jobs": {"small": {"state": "completed"}}}))
    [job] = await sim.jobs()
    assert (job.state, job.rounds_committed) == ("completed", 2)
    devices = {d.id: d for d in await sim.devices()}
    assert {d.state for d in devices.values()} == {"offline"}
    assert devices["d1"].rounds_served == 2 and devices["d9"].failures == {"timeout": 2}


async def test_a_new_run_in_the_same_directory_starts_over(tmp_path: Path) -> None:
    sim = source(tmp_path)
    metrics, part = tmp_path / "metrics.jsonl", tmp_path / "participation.jsonl"
    for r in (1, 2, 3):
        append(metrics, line(metrics_row(r, ["d1"])))
        append(part, line(served(r, "d1")))
    assert len(await sim.rounds("job-0")) == 3
    metrics.write_text(line(metrics_row(1, ["d5"])))
    part.write_text(line(served(1, "d5")))
    [r1] = await sim.rounds("job-0")
    assert r1.participants == ("d5",)
    assert {d.id for d in await sim.devices()} == {"d5", "d9"}


async def test_malformed_rows_are_skipped_not_served_as_errors(tmp_path: Path) -> None:
    sim = source(tmp_path)
    metrics, part = tmp_path / "metrics.jsonl", tmp_path / "participation.jsonl"
    append(metrics, line(metrics_row(1, ["d1"], round="one")))
    append(metrics, line(metrics_row(1, ["d1"], failures=[{"device_id": "d9"}])))
    append(metrics, line(metrics_row(1, ["d1"])))
    append(part, line({**served(1, "d1"), "num_samples": "many"}))
    append(part, line(served(1, "d1")))
    [r1] = await sim.rounds("job-0")
    assert r1.participants == ("d1",)
    assert {d.id: d.rounds_served for d in await sim.devices()} == {"d1": 1, "d9": 0}


async def test_subscribers_hear_of_new_rounds_each_change_once(tmp_path: Path) -> None:
    sim = SimulationSource(tmp_path, poll_s=0.05)
    metrics, part = tmp_path / "metrics.jsonl", tmp_path / "participation.jsonl"
    stream = sim.changes()
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0.2)
    assert not first.done()  # nothing written: nothing to say
    for r in (1, 2, 3):  # several rounds between two polls: one change per kind
        append(metrics, line(metrics_row(r, ["d1"])))
        append(part, line(served(r, "d1")))
    got = {await asyncio.wait_for(first, 5)}
    got.add(await asyncio.wait_for(stream.__anext__(), 5))
    assert got == {Change("job", "job-0"), Change("devices")}
    late = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0.2)
    assert not late.done()
    late.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await late
    await stream.aclose()


async def test_a_real_simulation_is_followed_while_it_runs(tmp_path: Path) -> None:
    """``flotilla simulate`` in a subprocess; the source is read while it writes."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "flotilla", "simulate", str(experiment_file(tmp_path)),
           "--out", str(out), "--no-progress", "--set", "job.rounds=12"]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *bound(cmd), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    sim = source(out)
    seen: list[int] = []
    try:
        finished = asyncio.ensure_future(proc.communicate())
        deadline = time.monotonic() + 90
        while not finished.done() and time.monotonic() < deadline:
            seen.append(len(await sim.rounds("job-0")) if await sim.jobs() else 0)
            await asyncio.sleep(0.05)
        _, err = await asyncio.wait_for(finished, 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert len(set(seen) - {0, 12}) >= 2, f"rounds seen while running: {sorted(set(seen))}"
    assert seen == sorted(seen)
    [job] = await sim.jobs()
    assert (job.state, job.rounds_committed, job.rounds_total) == ("completed", 12, 12)
    assert job.task == "flotilla.tasks.digits:DigitsTask"
    written = rows(out)
    assert job.metrics["accuracy"] == written[-1]["accuracy"]
    rounds = await sim.rounds("job-0")
    assert [len(r.participants) for r in rounds] == [r["participants"] for r in written]
    assert [r.selected for r in rounds] == [tuple(r["selected"]) for r in written]
    devices = await sim.devices()
    served_rows = rows(out, "participation.jsonl")
    assert {d.id: d.rounds_served for d in devices if d.rounds_served} == dict(
        Counter(p["device"] for p in served_rows)
    )
    failures = Counter(f["reason"] for r in written for f in r["failures"])
    assert sum((Counter(d.failures) for d in devices), Counter()) == failures
    assert {d.device_class for d in devices if d.rounds_served} <= {"phone", "server"}
    assert {d.state for d in devices} == {"offline"}


def test_flotilla_dashboard_serves_a_directory_with_a_fresh_read_token(tmp_path: Path) -> None:
    """The command itself: prints its URL with a token (on stdout), answers with that
    token only, serves the page, and stops cleanly on Ctrl-C."""
    (tmp_path / "metrics.jsonl").write_text(line(metrics_row(1, ["d1"])))
    (tmp_path / "participation.jsonl").write_text(line(served(1, "d1")))
    cmd = [sys.executable, "-m", "flotilla", "dashboard", str(tmp_path), "--port", "0"]
    proc = subprocess.Popen(bound(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        match = re.fullmatch(r"dashboard: (http://127\.0\.0\.1:(\d+)/)#token=(\S+)\n", first)
        assert match, first
        base, token = match.group(1), match.group(3)

        def get(path: str, with_token: str | None = token) -> tuple[int, bytes]:
            headers = {"Authorization": f"Bearer {with_token}"} if with_token else {}
            try:
                with urllib.request.urlopen(
                    urllib.request.Request(base + path, headers=headers), timeout=10
                ) as r:
                    return r.status, r.read()
            except urllib.error.HTTPError as err:
                return err.code, err.read()

        status, body = get("api/v1/jobs")
        assert status == 200 and json.loads(body)["jobs"][0]["rounds_committed"] == 1
        assert json.loads(get("api/v1/whoami")[1]) == {"scope": "read", "source": "simulation"}
        assert get("api/v1/jobs", None)[0] == 401
        assert get("api/v1/jobs", "someone-elses")[0] == 401
        status, page = get("", None)
        assert status == 200 and b"<title>Flotilla dashboard</title>" in page
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0
        assert token not in (proc.stderr.read() if proc.stderr else "")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_flotilla_dashboard_on_a_busy_port_says_what_to_do(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "flotilla", "dashboard", str(tmp_path)]
        done = subprocess.run(
            bound([*cmd, "--port", str(port)]),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2, done.stderr
    assert "--port 0" in done.stderr and "Traceback" not in done.stderr
