"""Device conditions in real rounds on the server core: who is selected under a job's
``[eligibility]``, what happens when a device stops qualifying mid-round (through the
server's own check, a device's report and the agent's GiveUp), and per-device uplink codecs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from flotilla.compression import UpdatePipeline, make_codec
from flotilla.core.conditions import DeviceConditions
from flotilla.core.device import DeviceProfile
from flotilla.core.errors import WireError
from flotilla.core.tensors import decode_state
from flotilla.core.timeouts import Timeouts
from flotilla.core.work import UploadHeader
from flotilla.engine.backend import TrainTask
from tests.support.hand_device import HandDevice, delta
from tests.support.inproc import DIGITS, InProcessFederation, in_process_federation, poll_until
from tests.support.slow_task import SLOW_DIGITS

pytestmark = pytest.mark.timeout(120)

ON = DeviceConditions(charging=True)
OFF = DeviceConditions(charging=False)


async def _task(hand: HandDevice, job_id: str, conditions: DeviceConditions | None) -> TrainTask:
    """Poll with ``conditions`` (and the hand's profile) until a round of ``job_id`` comes."""

    async def offered() -> TrainTask:
        while True:
            fed = hand.fed.federation
            task = await fed.poll(hand.record, hand.profile, conditions=conditions)
            if task is not None and task.order.job_id == job_id:
                return task

    return await asyncio.wait_for(offered(), 60)


async def _failures(fed: InProcessFederation, want: dict[str, dict[str, int]]) -> None:
    """Until the rounds' failure counts are ``want`` (a closed round reports them)."""

    async def counted() -> bool:
        return fed.federation.device_failures() == want

    if not await poll_until(counted, 10):
        raise AssertionError(f"{fed.federation.device_failures()} != {want}")


async def _never_offered(hand: HandDevice, offers: list[TrainTask]) -> None:
    """Poll, unplugged, for as long as the test runs; every offer is a failure."""
    while True:
        task = await hand.fed.federation.poll(hand.record, hand.profile, conditions=OFF)
        if task is not None:
            offers.append(task)


async def test_an_unplugged_device_is_never_selected_and_one_unplugged_mid_round_drops_out(
    db_url: str, digits_spec: Path, tmp_path: Path
) -> None:
    async with in_process_federation(tmp_path / "state", db_url) as fed:
        core = fed.federation
        charged, unplugged = await HandDevice.enrol(fed), await HandDevice.enrol(fed)
        offers: list[TrainTask] = []
        watcher = asyncio.ensure_future(_never_offered(unplugged, offers))
        try:
            job_id = await fed.submit(
                digits_spec,
                "job.rounds=2",
                "job.clients_per_round=1",
                "job.min_quorum=1",
                "eligibility.require_charging=true",
            )
            task = await _task(charged, job_id, ON)
            assert '"require_charging": true' in task.order.config_json  # devices see it
            listed = {d["id"]: d for d in await fed.devices()}
            assert listed[unplugged.record.id]["state"] == "ineligible"
            assert listed[unplugged.record.id]["reason"] == f"{job_id}: not charging"
            assert listed[unplugged.record.id]["ineligible"] == {job_id: "not charging"}
            assert listed[unplugged.record.id]["conditions"]["charging"] is False

            # Unplugged while training: its next heartbeat says so and the round lets it go.
            assert core.heartbeat(charged.record, task.order.round_token, OFF) is False
            await _failures(fed, {charged.record.id: {"conditions": 1}})
            # Plugged in again, it gets the round's retry; a device's own report of a
            # condition is a "conditions" dropout too.
            task = await _task(charged, job_id, ON)
            core.report_failure(charged.record, task.order.ref, "not charging")
            await _failures(fed, {charged.record.id: {"conditions": 2}})
            for _ in range(2):
                task = await _task(charged, job_id, ON)
                await charged.upload(task, delta(task))
            status = await fed.wait_for(job_id, timeout=60)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    assert status["state"] == "completed", status
    assert offers == [], "an unplugged device was offered a round"


async def test_an_agent_unplugged_while_training_gives_its_round_up(
    db_url: str, digits_spec: Path, tmp_path: Path
) -> None:
    plugged = {"a": True, "b": False}

    def reading(name: str) -> DeviceConditions:
        return DeviceConditions(charging=plugged[name])

    beats = Timeouts(heartbeat_every_s=0.2)
    async with in_process_federation(tmp_path / "state", db_url, agent_timeouts=beats) as fed:
        a, b = await fed.start_agents(
            2, task=SLOW_DIGITS, conditions=(lambda: reading("a"), lambda: reading("b"))
        )
        await fed.wait_devices(2, timeout=60)
        job_id = await fed.submit(
            digits_spec,
            f"job.task={SLOW_DIGITS!r}".replace("'", '"'),
            "job.rounds=1",
            "job.clients_per_round=1",
            "job.min_quorum=1",
            "train.params.sleep_s=3.0",
            "eligibility.require_charging=true",
        )
        await fed.wait_devices(1, timeout=30, state="busy")
        devices = {d["id"]: d for d in await fed.devices()}
        assert devices[a.device_id]["state"] == "busy", devices
        plugged["a"], plugged["b"] = False, True  # a is unplugged mid-round, b plugged in
        status = await fed.wait_for(job_id, timeout=90)
        rounds = (await fed.status(job_id, rounds=True))["rounds"]
        failures = fed.federation.device_failures()
    assert status["state"] == "completed", status
    assert [d["device_id"] for d in rounds[0]["devices"]] == [b.device_id]
    assert failures == {a.device_id: {"conditions": 1}}
    assert a.rounds_done == 0, "the unplugged agent uploaded anyway"


async def _upload(hand: HandDevice, task: TrainTask, payload: bytes, codec: str) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield payload

    header = UploadHeader(
        task.order.ref, 10, len(payload), hashlib.sha256(payload).hexdigest(), codec
    )
    await hand.fed.federation.submit_update(hand.record, hand.signed(header), chunks())


async def test_each_device_gets_the_codec_its_uplink_earns_and_must_use_it(
    db_url: str, digits_spec: Path, tmp_path: Path
) -> None:
    async with in_process_federation(tmp_path / "state", db_url) as fed:
        fast, slow = await HandDevice.enrol(fed), await HandDevice.enrol(fed)
        fast.profile = DeviceProfile("", tasks=(DIGITS,), gflops=1.0, upload_bytes_per_s=1e6)
        slow.profile = DeviceProfile("", tasks=(DIGITS,), gflops=1.0, upload_bytes_per_s=1e5)
        for hand in (fast, slow):  # the server learns each measured uplink
            assert await fed.federation.poll(hand.record, hand.profile) is None
        job_id = await fed.submit(
            digits_spec,
            "job.rounds=1",
            "job.clients_per_round=2",
            "job.min_quorum=2",
            'compression.uplink_by_mbps=[[5.0, "int8"]]',
        )
        fast_task, slow_task = await asyncio.gather(
            fast.task_of(job_id, 60), slow.task_of(job_id, 60)
        )
        assert fast_task.order.uplink_codec == "int8"  # 8 Mbit/s
        assert slow_task.order.uplink_codec == "none"  # 0.8 Mbit/s: compression.uplink
        plain = delta(fast_task, fill=0.01)
        with pytest.raises(WireError, match="this device's uplink codec is 'int8'"):
            await _upload(fast, fast_task, plain, "")
        with pytest.raises(WireError, match="this device's uplink codec is 'none'"):
            await _upload(slow, slow_task, plain, "int8")
        int8 = UpdatePipeline(make_codec("int8")).encode("fast", decode_state(plain))
        await _upload(fast, fast_task, int8, "int8")
        await _upload(slow, slow_task, plain, "none")
        status = await fed.wait_for(job_id, timeout=60)
        devices = (await fed.status(job_id, rounds=True))["rounds"][0]["devices"]
    assert status["state"] == "completed", status
    sent = {d["device_id"]: d["metrics"]["bytes_up"] for d in devices}
    assert sent == {fast.record.id: len(int8), slow.record.id: len(plain)}
    assert len(int8) < len(plain) / 3, "int8 costs about a quarter of float32's bytes"
