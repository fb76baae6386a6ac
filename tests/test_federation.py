"""A federation end to end on real data: the server core and real agents in one process,
then real server and agent processes on 127.0.0.1 where processes are the point (kill -9,
an agent killed mid-upload, Ctrl-C, the operator CLI)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from flotilla.core.errors import SpecError
from flotilla.core.records import JobRecord
from tests.support.inproc import InProcessFederation
from tests.support.lifetime import bound
from tests.support.processes import DIGITS, AgentFleet, ServerProcess, flotilla

pytestmark = pytest.mark.timeout(600)


def read_store(server: ServerProcess, what: str) -> list:
    """Rows straight from the server's database: ``participations`` or ``devices``."""
    import asyncio

    from flotilla.server.federation.store import Store, default_url

    async def read() -> list:
        store = await Store.open(server.db_url or default_url(server.state_dir))
        try:
            return await getattr(store, f"list_{what}")()
        finally:
            await store.close()

    return asyncio.run(read())


def participations(server: ServerProcess) -> list:
    return read_store(server, "participations")


# --- in one process: the server core and real agents over the in-process transport ------


async def test_five_agents_learn_digits(
    in_process: InProcessFederation, digits_spec: Path, tmp_path: Path
) -> None:
    await in_process.start_agents(5)
    job_id = await in_process.submit(
        digits_spec, "job.rounds=20", "data.alpha=0.5", "job.name=five"
    )
    status = await in_process.wait_for(job_id, timeout=300)
    assert status["state"] == "completed", status
    assert status["rounds_committed"] == status["rounds_total"] == 20
    assert status["metrics"]["accuracy"] >= 0.90, status

    detailed = await in_process.status(job_id, rounds=True)
    rounds = detailed["rounds"]
    assert [r["round"] for r in rounds] == list(range(1, 21))
    for r in rounds:
        assert set(r) >= {"round", "metrics", "participants", "started_at", "committed_at"}
        assert 2 <= len(r["participants"]) <= 4
        assert r["started_at"] <= r["committed_at"]
    assert {"id", "name", "state", "rounds_committed", "rounds_total", "metrics"} <= set(detailed)

    assert [j["id"] for j in await in_process.jobs()] == [job_id]

    out = tmp_path / "model.safetensors"
    out.write_bytes(await in_process.export(job_id))
    exported = load_file(str(out))
    assert exported and all(np.isfinite(v).all() for v in exported.values())


async def test_two_jobs_share_eight_agents_without_overlap(
    in_process: InProcessFederation, digits_spec: Path
) -> None:
    await in_process.start_agents(8)
    jobs = [
        await in_process.submit(
            digits_spec,
            "job.rounds=20",
            "job.clients_per_round=4",
            f"job.name=j{i}",
            f"job.seed={i}",
        )
        for i in range(2)
    ]
    for job_id in jobs:
        status = await in_process.wait_for(job_id, timeout=400)
        assert status["state"] == "completed", status
        assert status["metrics"]["accuracy"] >= 0.90, status

    rows = await in_process.participations()
    assert {r.job_id for r in rows} == set(jobs)
    assert_one_job_at_a_time(rows)


def assert_one_job_at_a_time(rows: list) -> None:
    """No device's participations in two jobs overlap in time."""
    by_device: dict[str, list] = {}
    for r in rows:
        by_device.setdefault(r.device_id, []).append(r)
    for device, spans in by_device.items():
        spans.sort(key=lambda r: r.started_at)
        for a, b in itertools.pairwise(spans):
            if a.job_id != b.job_id:
                assert a.finished_at <= b.started_at, f"{device} served two jobs at once: {a} {b}"


async def test_learned_selectors_share_real_agents_decided_jointly(
    in_process: InProcessFederation, digits_spec: Path
) -> None:
    """Three jobs, three selectors, six agents: the arbiter splits the fleet between the
    jobs that ask at once; no device serves two jobs at a time."""
    await in_process.start_agents(6)
    jobs = [
        await in_process.submit(
            digits_spec,
            "job.rounds=6",
            "job.clients_per_round=4",  # 12 wanted of 6 agents: the jobs wait together
            "job.min_quorum=2",
            f"job.name={selector}",
            f"scheduling.selector={selector}",
        )
        for selector in ("rl", "bayesian", "oort")
    ]
    contenders = []
    for job_id in jobs:
        status = await in_process.wait_for(job_id, timeout=400)
        assert status["state"] == "completed", status
        rounds = (await in_process.status(job_id, rounds=True))["rounds"]
        contenders += [r["metrics"]["sched_contenders"] for r in rounds]
        assert all(r["metrics"]["sched_selected"] >= 1 for r in rounds)
    assert max(contenders) >= 2, "jobs asking at once are decided together"
    with pytest.raises(SpecError, match="policy_file"):
        await in_process.submit(
            digits_spec,
            "scheduling.selector=rl",
            "scheduling.params.policy_file=/nonexistent/policy.json",
        )
    assert len(await in_process.jobs()) == 3
    devices = await in_process.devices()
    assert len(devices) == 6 and {d["state"] for d in devices} == {"idle"}
    assert sum(sum(d["selected"].values()) for d in devices) >= 3 * 6 * 2
    other = await in_process.devices("x.y:Other")
    assert {(d["state"], d["reason"]) for d in other} == {
        ("ineligible", "task x.y:Other is not installed")
    }
    assert_one_job_at_a_time(await in_process.participations())


# --- real processes: where killing, signals and the CLI are the point ---------------------


ROUNDS = 30


@pytest.mark.slow
def test_kill_9_mid_round_then_restart_resumes(
    server: ServerProcess, fleet: AgentFleet, digits_spec: Path
) -> None:
    fleet.start(5)
    job_id = server.submit(
        digits_spec, f"job.rounds={ROUNDS}", "job.name=crashy", "scheduling.selector=rl"
    )
    server.wait_rounds(job_id, 10, timeout=300)  # agents import torch first; CI is slow
    server.kill9()
    at_kill = job_row(server, job_id).rounds_committed
    assert 10 <= at_kill < ROUNDS, "the kill must land mid-job"
    enrolled = {d.id for d in read_store(server, "devices")}
    assert len(enrolled) == 5
    time.sleep(1.0)
    assert fleet.alive() == 5, "agents must survive the server's death"
    server.start()  # same state dir, same port
    status = server.wait_for(job_id, timeout=300)
    assert status["state"] == "completed", status

    rounds = server.status(job_id, rounds=True)["rounds"]
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1)), "each round exactly once"
    rows = participations(server)
    keys = [(r.round, r.device_id) for r in rows]
    assert len(keys) == len(set(keys))
    last = max(r["committed_at"] for r in rounds)
    after = {r.device_id for r in rows if r.finished_at > last - 5}
    assert after and after <= enrolled, "the same agents came back by themselves"
    assert {d.id for d in read_store(server, "devices")} == enrolled, "nobody enrolled again"
    assert fleet.alive() == 5
    # The scheduler's history and the rl policy came back with the job: the history counts
    # every committed update, the policy learned from every committed round (not only
    # those after the crash; the round the kill cut short may be retried and learned twice).
    state = scheduler_state(server, job_id)
    history = state["history"]
    assert sum(r["delivered"] for r in history["records"].values()) == len(rows)
    assert history["round"] == ROUNDS
    assert ROUNDS - 3 <= state["selector"]["updates"] <= ROUNDS + 3


def job_row(server: ServerProcess, job_id: str) -> JobRecord:
    """The job as the database holds it (also while the server is down)."""
    import asyncio

    from flotilla.server.federation.store import Store, default_url

    async def read() -> JobRecord | None:
        store = await Store.open(server.db_url or default_url(server.state_dir))
        try:
            return await store.get_job(job_id)
        finally:
            await store.close()

    job = asyncio.run(read())
    assert job is not None
    return job


def scheduler_state(server: ServerProcess, job_id: str) -> dict:
    sha = job_row(server, job_id).scheduler_sha256
    assert sha, "the job's rounds commit the scheduler's history"
    return json.loads((server.state_dir / "blobs" / sha[:2] / sha).read_text())


@pytest.mark.slow
def test_agent_killed_mid_upload_leaves_nothing(
    server: ServerProcess, fleet: AgentFleet, digits_spec: Path
) -> None:
    token = fleet.token
    half = subprocess.Popen(
        bound(
            [
                sys.executable,
                str(Path(__file__).parent / "support" / "half_upload_agent.py"),
                server.address,
                token,
                DIGITS,
            ]
        ),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert half.stdout is not None
    dying_device = half.stdout.readline().strip()
    assert dying_device.startswith("dev-")
    fleet.start(4)
    server.wait_devices(5, timeout=120)  # all five enrolled and idle, so all are selected
    job_id = server.submit(
        digits_spec,
        "job.rounds=3",
        "job.clients_per_round=5",
        "job.min_quorum=3",
        "job.round_deadline_s=30",
        "job.name=halfway",
    )
    try:
        half.wait(120)
    except subprocess.TimeoutExpired:
        half.kill()
        half.wait(10)
    assert half.returncode == -9, (
        "the agent died by SIGKILL mid-upload",
        half.returncode,
        server.log.read_text()[-4000:],
    )
    status = server.wait_for(job_id, timeout=180)
    assert status["state"] == "completed", status
    rows = participations(server)
    assert rows and dying_device not in {r.device_id for r in rows}, (dying_device, rows)
    rounds = server.status(job_id, rounds=True)["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3], rounds
    blobs = [p for p in (server.state_dir / "blobs").rglob("*") if p.is_file()]
    assert not [p for p in blobs if p.name.startswith(".tmp")], blobs
    # Scheduling state is a small JSON blob per round; models are safetensors.
    models = [p for p in blobs if not p.read_bytes().startswith(b'{"history"')]
    seen = (models, rounds)
    assert len(models) == 4, f"round 0 and three committed checkpoints, no partial upload: {seen}"
    assert len(blobs) - len(models) == 3, f"one scheduling state per committed round: {blobs}"


def test_ctrl_c_leaves_cleanly_and_cancel_stops_a_job(
    server: ServerProcess, fleet: AgentFleet, digits_spec: Path, tmp_path: Path
) -> None:
    """Cancel and Ctrl-C, and on the way what the in-process tests check through the facade,
    once through the operator CLI and a real server: job list, export, a refusal by name,
    devices list (also for a task nobody installed)."""
    fleet.start(2)
    job_id = server.submit(
        digits_spec, "job.rounds=500", "job.clients_per_round=2", "job.name=long"
    )
    server.wait_rounds(job_id, 1, timeout=300)
    cancelled = server.operator("job", "cancel", job_id).stdout
    assert "cancelled" in cancelled
    committed = server.status(job_id)["rounds_committed"]
    time.sleep(1.5)
    status = server.status(job_id)
    assert status["state"] == "cancelled" and status["rounds_committed"] == committed

    listing = json.loads(server.operator("job", "list", "--json").stdout)
    assert [j["id"] for j in listing] == [job_id]
    out = tmp_path / "model.safetensors"
    server.operator("job", "export", job_id, "--out", str(out))
    exported = load_file(str(out))
    assert exported and all(np.isfinite(v).all() for v in exported.values())
    refused = server.operator(
        "job", "submit", str(digits_spec), "--set", "scheduling.selector=rl",
        "--set", "scheduling.params.policy_file=/nonexistent/policy.json", check=False,
    )  # fmt: skip
    assert refused.returncode != 0 and "policy_file" in refused.stderr
    server.wait_devices(2, timeout=60)
    devices = json.loads(server.operator("devices", "list", "--json").stdout)
    assert len(devices) == 2 and {d["state"] for d in devices} == {"idle"}
    assert sum(sum(d["selected"].values()) for d in devices) >= 2 * committed
    other = json.loads(server.operator("devices", "list", "--task", "x.y:Other", "--json").stdout)
    assert {(d["state"], d["reason"]) for d in other} == {
        ("ineligible", "task x.y:Other is not installed")
    }

    agent = fleet.procs[0]
    started = time.monotonic()
    agent.send_signal(2)  # SIGINT, as Ctrl-C
    assert agent.wait(15) == 0
    assert time.monotonic() - started < 15
    assert "left (agent stopped)" in server.log.read_text()


def test_cli_help_for_every_command() -> None:
    for args in (
        [], ["server"], ["server", "token", "create"], ["client"], ["job"],
        ["job", "submit"], ["job", "list"], ["job", "status"], ["job", "cancel"],
        ["job", "export"], ["job", "plot"], ["devices"], ["devices", "list"], ["demo"],
        ["simulate"], ["volunteer", "runs"], ["volunteer", "status"], ["data"], ["data", "shard"],
    ):  # fmt: skip
        out = flotilla(*args, "--help").stdout
        assert "usage: flotilla" in out
