"""Strategies and codecs chosen per job, run end to end on a real server and real agents.

One server and one fleet serve several jobs at once (a device serves one job at a time),
each exercising a different path: a server optimizer with compressed uplink and downlink,
a robust rule that spools to disk, differential privacy with a budget, and FedBuff.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from flotilla.core.tensors import decode_state
from tests.conftest import AgentFleet, ServerProcess

#: The module's jobs share one fleet and are set up once, in the first test.
pytestmark = pytest.mark.timeout(900)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits.toml"
#: Parameters of the digits MLP (64-256-128-10), float32 on the wire.
MODEL_PARAMS = 64 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("strategies")
    server = ServerProcess(root / "state")
    server.start()
    fleet = AgentFleet(server, server.token(), root)
    fleet.start(6)
    try:
        yield server
    finally:
        fleet.stop()
        server.stop()


@pytest.fixture(scope="module")
def jobs(federation: ServerProcess) -> dict[str, dict]:
    """Submit every job at once, then wait for all of them."""
    common = ("job.clients_per_round=3", "job.min_quorum=2", "data.alpha=1.0")
    submitted = {
        "fedadam_int8": federation.submit(
            EXAMPLE, *common, "job.rounds=12", "job.name=fedadam-int8",
            "aggregation.strategy=fedadam", "aggregation.params.eta=0.01",
            "compression.uplink=int8", "compression.error_feedback=true",
            "compression.downlink=fp16",
        ),
        "median": federation.submit(
            EXAMPLE, *common, "job.rounds=6", "job.name=median", "aggregation.strategy=median"
        ),
        "dp": federation.submit(
            EXAMPLE, *common, "job.rounds=50", "job.name=private",
            "aggregation.strategy=dp_fedavg", "aggregation.params.noise_multiplier=1.5",
            "aggregation.params.clip_norm=0.5", "aggregation.params.epsilon=6.0",
        ),
        # More rounds than the others: once it has the fleet to itself, devices serve it
        # in consecutive rounds and hold its last broadcast (a device serving another job
        # in between holds that job's model instead), so deltas are certain to be used.
        "delta": federation.submit(
            EXAMPLE, *common, "job.rounds=20", "job.name=delta-downlink",
            "compression.downlink=int8", "compression.downlink_delta=true",
        ),
        "fedbuff": federation.submit(
            EXAMPLE, *common, "job.rounds=8", "job.name=buffered",
            "aggregation.strategy=fedbuff", "aggregation.params.buffer_size=2",
        ),
    }  # fmt: skip
    return {
        key: federation.status(federation.wait_for(job_id, timeout=600)["id"], rounds=True)
        for key, job_id in submitted.items()
    }


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
    jobs: dict[str, dict], federation: ServerProcess
) -> None:
    import asyncio

    from flotilla.core.blobstore import BlobStore
    from flotilla.server.federation.store import Store, default_url

    async def read() -> str:
        store = await Store.open(default_url(federation.state_dir))
        try:
            job = await store.get_job(jobs["fedadam_int8"]["id"])
            assert job is not None
            return job.aggregator_sha256
        finally:
            await store.close()

    sha = asyncio.run(read())
    assert sha, "a stateful strategy commits its state with the round"
    state = decode_state(BlobStore(federation.state_dir / "blobs").get(sha))
    assert float(state["fedadam/rounds"]) == 12
    assert {n for n in state if n.startswith("fedadam/m/")} == {
        n.replace("fedadam/v/", "fedadam/m/") for n in state if n.startswith("fedadam/v/")
    }
    assert len(state) == 1 + 2 * 6, "m and v for each of the MLP's six tensors"


def test_robust_rule_spools_to_disk_and_cleans_up(
    jobs: dict[str, dict], federation: ServerProcess
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
