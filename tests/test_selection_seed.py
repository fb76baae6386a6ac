"""The server seeds selection from ``job.seed`` (core/spec.py), as the simulator does:
the same spec with the same seed selects the same devices in round 1."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from flotilla.core.timeouts import Timeouts
from flotilla.proto import flotilla_pb2 as pb
from tests.support.live_grpc import Device, LiveServer, live_server

pytestmark = pytest.mark.timeout(120)

DEVICES = 8


async def _keep_alive(live: LiveServer, devices: list[Device]) -> None:
    """One short poll each: the devices are online and idle (no job is running)."""
    for device in devices:
        reply = await live.agent.Poll(pb.PollRequest(), metadata=device.md, timeout=10)
        assert not reply.HasField("task")


async def _devices_in(live: LiveServer, state: str, job_id: str, count: int) -> frozenset[str]:
    """The devices in ``state`` (for ``job_id``), once there are ``count`` of them."""
    deadline = time.monotonic() + 60
    while True:
        reply = await live.operator.ListDevices(
            pb.ListDevicesRequest(), metadata=live.op_md, timeout=10
        )
        found = frozenset(d.id for d in reply.devices if d.state == state and d.job_id == job_id)
        if len(found) >= count:
            return found
        assert time.monotonic() < deadline, f"never {count} devices {state} {job_id}"
        await asyncio.sleep(0.05)


async def _round_one(live: LiveServer, devices: list[Device], seed: int) -> frozenset[str]:
    await _keep_alive(live, devices)
    job_id = await live.submit(
        "scheduling.selector=random",
        "job.clients_per_round=3",
        "job.min_quorum=3",
        f"job.seed={seed}",
    )
    chosen = await _devices_in(live, "busy", job_id, 3)
    await live.operator.CancelJob(pb.GetJobRequest(job_id=job_id), metadata=live.op_md, timeout=30)
    await _devices_in(live, "idle", "", DEVICES)  # offers never picked up: all free again
    return chosen


async def test_the_same_spec_and_seed_select_the_same_devices_in_round_1(tmp_path: Path) -> None:
    timeouts = Timeouts(liveness_s=30.0, poll_hold_s=0.05)
    async with live_server(tmp_path / "state", timeouts=timeouts) as live:
        devices = [await live.enrol() for _ in range(DEVICES)]
        first = await _round_one(live, devices, seed=7)
        again = await _round_one(live, devices, seed=7)
        others = [await _round_one(live, devices, seed=s) for s in (8, 9)]
    assert again == first
    assert any(o != first for o in others), "the seed, not the spec alone, decides"
