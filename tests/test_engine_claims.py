"""The engine hands claimed devices to the backend before anything else can run.

A device the gateway has no task for looks idle to it: an agent polling in that moment
frees itself, and another job could claim it. So between the claim and the dispatch the
engine must not await. Here idle agents poll without pause while a job runs rounds, and
the backend checks at every dispatch that the job still holds each device it offers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from flotilla.core.blobstore import BlobStore
from flotilla.core.device import DeviceProfile
from flotilla.core.records import JobRecord, RoundCommit
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import encode_state
from flotilla.core.update import Update
from flotilla.engine import EngineConfig, EngineServices, JobRunner, TrainTask
from flotilla.scheduling import Arbiter, DevicePool, Leases, RandomSelector
from flotilla.server.federation.gateway import Gateway, RoundStream

pytestmark = pytest.mark.timeout(60)

TASK = "pkg.mod:Task"


class Ledger:
    def __init__(self, job: JobRecord) -> None:
        self.job = job

    async def commit_round(self, commit: RoundCommit) -> JobRecord:
        state = "completed" if commit.round >= self.job.rounds_total else self.job.state
        self.job = dataclasses.replace(
            self.job,
            rounds_committed=commit.round,
            checkpoint_sha256=commit.checkpoint_sha256,
            state=state,
        )
        return self.job

    async def set_job_state(self, job_id: str, state: str) -> JobRecord:
        self.job = dataclasses.replace(self.job, state=state)
        return self.job


class Checked:
    """The gateway, with a look at the pool whenever the engine dispatches."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.freed: list[str] = []
        self.dispatches = 0

    def dispatch(self, task: TrainTask, device_ids: Sequence[str]) -> RoundStream:
        self.dispatches += 1
        pool = self.gateway.pool
        self.freed += [d for d in device_ids if pool.busy_with(d) != task.order.job_id]
        return self.gateway.dispatch(task, device_ids)


async def agent(gateway: Gateway, device_id: str) -> None:
    """Polls without pause; answers every task with a zero update."""
    while True:
        task = await gateway.poll(device_id, 0.001)
        if task is None:
            await asyncio.sleep(0)
            continue
        round_ = gateway.expect(
            device_id, task.order.job_id, task.order.round, task.order.round_token
        )
        delta = {"w": np.zeros(4, dtype=np.float32)}
        update = Update(task.order.job_id, task.order.round, device_id, 10, delta)
        await gateway.deliver(round_, update, 5.0)


async def test_no_device_is_freed_between_its_claim_and_its_dispatch(tmp_path: Path) -> None:
    pool = DevicePool(clock=time.time)
    devices = [f"d{i}" for i in range(6)]
    for d in devices:
        pool.seen(DeviceProfile(d, tasks=(TASK,)))
    leases = Leases(pool)
    gateway = Gateway(pool, time.time, leases)
    backend = Checked(gateway)
    blobs = BlobStore(tmp_path / "blobs")
    spec = JobSpec.from_dict(
        {"job": {"task": TASK, "rounds": 6, "clients_per_round": 3, "min_quorum": 3}}
    )
    job = JobRecord(
        id="job-1",
        name="j",
        spec_json=spec.to_json(),
        state="pending",
        rounds_total=6,
        rounds_committed=0,
        checkpoint_sha256=blobs.put(encode_state({"w": np.ones(4, dtype=np.float32)})),
        created_at=0.0,
        updated_at=0.0,
    )
    config = EngineConfig(selection_grace_s=0.01, idle_poll_s=0.001)
    arbiter = Arbiter(pool, time.time, config.selection_grace_s, config.idle_poll_s)
    services = EngineServices(backend, leases, arbiter, Ledger(job), blobs, time.time, config)
    runner = JobRunner(job, spec, services, RandomSelector(random.Random(0)), evaluator=None)
    agents = [asyncio.ensure_future(agent(gateway, d)) for d in devices]
    try:
        done = await asyncio.wait_for(runner.run(), timeout=30)
    finally:
        await arbiter.close()
        for task in agents:
            task.cancel()
        await asyncio.gather(*agents, return_exceptions=True)
    assert done.rounds_committed == 6
    assert backend.dispatches == 6
    assert backend.freed == [], "devices were freed before their task was offered"
