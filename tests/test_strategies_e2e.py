"""Strategies and codecs chosen per job, run end to end on the server core and real agents.

One federation and one fleet of six real agents (in one process, over the in-process
transport) serve several jobs at once (a device serves one job at a time), each exercising
a different path: a server optimizer with compressed uplink and downlink, a robust rule
that spools to disk, differential privacy with a budget, and FedBuff.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from flotilla.core.tensors import decode_state
from tests.support.databases import database_url, deployment_database
from tests.support.inproc import in_process_federation

#: The module's jobs share one fleet and run once, for every test.
# One worker runs the whole module (xdist group), so its module-scoped run happens once.
pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group(__name__)]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits.toml"
#: Parameters of the digits MLP (64-256-128-10), float32 on the wire.
MODEL_PARAMS = 64 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10


@dataclass(frozen=True)
class Federation:
    """What the module's run left: its state dir and the ``job status --json --rounds``
    of every job, by key."""

    state_dir: Path
    aggregator_sha256: dict[str, str]
    jobs: dict[str, dict[str, Any]]


def submissions() -> dict[str, tuple[str, ...]]:
    common = ("job.clients_per_round=3", "job.min_quorum=2", "data.alpha=1.0")
    return {
        "fedadam_int8": (
            *common, "job.rounds=12", "job.name=fedadam-int8",
            "aggregation.strategy=fedadam", "aggregation.params.eta=0.01",
            "compression.uplink=int8", "compression.error_feedback=true",
            "compression.downlink=fp16",
        ),
        "median": (*common, "job.rounds=6", "job.name=median", "aggregation.strategy=median"),
        "dp": (
            *common, "job.rounds=50", "job.name=private",
            "aggregation.strategy=dp_fedavg", "aggregation.params.noise_multiplier=1.5",
            "aggregation.params.clip_norm=0.5", "aggregation.params.epsilon=6.0",
        ),
        # More rounds than the others: once it has the fleet to itself, devices serve it
        # in consecutive rounds and hold its last broadcast (a device serving another job
        # in between holds that job's model instead), so deltas are certain to be used.
        "delta": (
            *common, "job.rounds=20", "job.name=delta-downlink",
            "compression.downlink=int8", "compression.downlink_delta=true",
        ),
        "fedbuff": (
            *common, "job.rounds=8", "job.name=buffered",
            "aggregation.strategy=fedbuff", "aggregation.params.buffer_size=2",
        ),
    }  # fmt: skip


async def run_jobs(root: Path) -> Federation:
    """Six agents; submit every job at once, then wait for all of them."""
    state_dir = root / "state"
    url = database_url(deployment_database(), root)
    async with in_process_federation(state_dir, url) as fed:
        await fed.start_agents(6)
        submitted = {key: await fed.submit(EXAMPLE, *sets) for key, sets in submissions().items()}
        jobs = {}
        for key, job_id in submitted.items():
            await fed.wait_for(job_id, timeout=600)
            jobs[key] = await fed.status(job_id, rounds=True)
        states = {}
        for key, job_id in submitted.items():
            job = await fed.store.get_job(job_id)
            assert job is not None
            states[key] = job.aggregator_sha256
    return Federation(state_dir, states, jobs)


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Federation:
    return asyncio.run(run_jobs(tmp_path_factory.mktemp("strategies")))


@pytest.fixture(scope="module")
def jobs(federation: Federation) -> dict[str, dict]:
    return federation.jobs


def test_server_optimizer_with_compressed_uplink_and_downlink(jobs: dict[str, dict]) -> None:
    job = jobs["fedadam_int8"]
    assert job["state"] == "completed", job
    assert job["rounds_committed"] == 12
    assert job["metrics"]["accuracy"] > 0.6, job["metrics"]
    for rnd in job["rounds"]:
        # int8 with 256-value blocks: 1 byte per parameter plus a float32 scale per block.
        assert 3.5 < rnd["metrics"]["compression_ratio"] < 4.0, rnd["metrics"]
        for device in rnd["devices"]:
            up, down = device["metrics"]["bytes_up"], device["metrics"]["bytes_down"]
            assert up == pytest.approx(MODEL_PARAMS * (1 + 4 / 256), rel=0.05)
            # fp16 broadcast: half the float32 model, measured on the server's side.
            assert down == pytest.approx(MODEL_PARAMS * 2, rel=0.05)
        assert rnd["metrics"]["bytes_up"] == sum(d["metrics"]["bytes_up"] for d in rnd["devices"])


def test_fedadam_state_is_committed_with_each_round(
    jobs: dict[str, dict], federation: Federation
) -> None:
    from flotilla.core.blobstore import BlobStore

    sha = federation.aggregator_sha256["fedadam_int8"]
    assert sha, "a stateful strategy commits its state with the round"
    state = decode_state(BlobStore(federation.state_dir / "blobs").get(sha))
    assert float(state["fedadam/rounds"]) == 12
    assert {n for n in state if n.startswith("fedadam/m/")} == {
        n.replace("fedadam/v/", "fedadam/m/") for n in state if n.startswith("fedadam/v/")
    }
    assert len(state) == 1 + 2 * 6, "m and v for each of the MLP's six tensors"


def test_robust_rule_spools_to_disk_and_cleans_up(
    jobs: dict[str, dict], federation: Federation
) -> None:
    job = jobs["median"]
    assert job["state"] == "completed", job
    assert job["metrics"]["accuracy"] > 0.5, job["metrics"]
    spool = federation.state_dir / "spool" / job["id"]
    assert not spool.exists() or not any(p.is_file() for p in spool.rglob("*")), (
        "a finished round leaves no spooled update behind"
    )


def test_privacy_budget_stops_the_job_and_epsilon_is_reported(jobs: dict[str, dict]) -> None:
    job = jobs["dp"]
    assert job["state"] == "completed", job
    eps = [r["metrics"]["epsilon"] for r in job["rounds"]]
    assert eps == sorted(eps), "epsilon only grows"
    assert eps[-1] <= 6.0 + 1e-9, "no round is started that would exceed the budget"
    # q = 3 of 6 devices per round at z = 1.5 allows nine rounds within epsilon 6.
    assert 3 <= job["rounds_committed"] < 50, "the budget, not the round count, ended it"
    assert all(math.isfinite(e) for e in eps)


def test_fedbuff_commits_every_buffer_of_updates(jobs: dict[str, dict]) -> None:
    job = jobs["fedbuff"]
    assert job["state"] == "completed", job
    assert job["rounds_committed"] == 8
    for rnd in job["rounds"]:
        assert rnd["metrics"]["updates"] == 2, "a new model every buffer_size arrivals"
    assert job["metrics"]["accuracy"] > 0.5, job["metrics"]


def test_downlink_deltas_reach_devices_that_hold_the_last_model(jobs: dict[str, dict]) -> None:
    job = jobs["delta"]
    assert job["state"] == "completed", job
    assert job["metrics"]["accuracy"] > 0.6, job["metrics"]
    full = MODEL_PARAMS * 4
    downloads = [d["metrics"]["bytes_down"] for r in job["rounds"] for d in r["devices"]]
    assert all(b == pytest.approx(full, rel=0.05) or b < 0.3 * full for b in downloads)
    assert any(b < 0.3 * full for b in downloads), (
        "a device that took part in the previous round fetches only the int8 change"
    )
