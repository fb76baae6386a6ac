"""Signed updates, in the core every edge calls: a captured upload replayed (same round,
next round, another job), signed by another device's key, with a flipped payload byte, or
from a device without a key is refused before it is read, and each refusal is recorded
with its reason; a revoked device is refused at its next call and its in-flight update
with reason ``revoked``, its round slot given up."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from flotilla.core.device import DeviceProfile
from flotilla.core.errors import (
    AuthError,
    ForbiddenError,
    StaleRoundError,
    UpdateRejected,
    WireError,
)
from flotilla.core.events import UpdateRefused
from flotilla.core.identity import DeviceIdentity
from flotilla.core.work import UploadHeader
from flotilla.engine.backend import TrainTask
from tests.support.hand_device import HandDevice, delta, sign_header
from tests.support.inproc import DIGITS, in_process_federation

pytestmark = pytest.mark.timeout(180)


@dataclasses.dataclass
class Captured:
    """An upload as a network attacker saw it: header and bytes."""

    header: UploadHeader
    payload: bytes


class Refusals:
    """The ``UpdateRefused`` events, as a sink hears them."""

    def __init__(self) -> None:
        self.seen: list[UpdateRefused] = []

    def emit(self, event: object) -> None:
        if isinstance(event, UpdateRefused):
            self.seen.append(event)


def header_for(task: TrainTask, payload: bytes) -> UploadHeader:
    return UploadHeader(task.order.ref, 10, len(payload), hashlib.sha256(payload).hexdigest(), "")


async def send(hand: HandDevice, header: UploadHeader, payload: bytes) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield payload

    await hand.fed.federation.submit_update(hand.record, header, chunks())


async def refused_with(
    hand: HandDevice, header: UploadHeader, payload: bytes, error: type[Exception]
) -> None:
    with pytest.raises(error):
        await send(hand, header, payload)


def at(header: UploadHeader, task: TrainTask) -> UploadHeader:
    """The header rewritten to name ``task``'s round (the signature left as it was)."""
    return dataclasses.replace(header, ref=task.order.ref)


async def test_replayed_forged_and_tampered_updates_are_refused_and_recorded(
    db_url: str, digits_spec: Path, tmp_path: Path
) -> None:
    sink = Refusals()
    async with in_process_federation(tmp_path / "state", db_url, sinks=(sink,)) as fed:
        me = await HandDevice.enrol(fed)
        stranger = DeviceIdentity.generate()
        one = "job.clients_per_round=1", "job.min_quorum=1"
        job_a = await fed.submit(digits_spec, "job.rounds=2", *one)

        # Round 1: forgeries and tampering, then the real update (captured on the way).
        task = await me.task_of(job_a, 60)
        good = delta(task, fill=0.01)
        honest = me.signed(header_for(task, good))
        await refused_with(me, sign_header(stranger, header_for(task, good)), good, UpdateRejected)
        unsigned = header_for(task, good)
        await refused_with(me, unsigned, good, UpdateRejected)
        flipped = bytes([good[-1] ^ 1])
        tampered = good[:-1] + flipped
        # A flipped byte under a signed header fails the SHA-256 the signature covers...
        seen = me.signed(header_for(task, good))
        await refused_with(me, seen, tampered, WireError)
        # ...and with the header's SHA-256 made to match, the signature no longer verifies.
        resummed = dataclasses.replace(
            me.signed(header_for(task, good)),
            payload_size=len(tampered),
            payload_sha256=hashlib.sha256(tampered).hexdigest(),
        )
        await refused_with(me, resummed, tampered, UpdateRejected)
        # The nonce of an attempt that got as far as reading is spent: sent again, a replay.
        junk = b"\x00" * len(good)
        junk_header = me.signed(header_for(task, junk))
        await refused_with(me, junk_header, junk, WireError)
        await refused_with(me, junk_header, junk, UpdateRejected)
        await send(me, honest, good)
        captured = Captured(honest, good)

        # Round 2: the captured upload, verbatim (its round is closed) and re-aimed.
        task = await me.task_of(job_a, 60)
        await refused_with(me, captured.header, captured.payload, StaleRoundError)
        await refused_with(me, at(captured.header, task), captured.payload, UpdateRejected)
        await send(me, me.signed(header_for(task, good)), good)
        await fed.wait_for(job_a, 60)

        # Another job: the captured update sent for it.
        job_b = await fed.submit(digits_spec, "job.rounds=1", *one)
        task = await me.task_of(job_b, 60)
        await refused_with(me, at(captured.header, task), captured.payload, UpdateRejected)
        await send(me, me.signed(header_for(task, good)), good)
        await fed.wait_for(job_b, 60)

        expected = [
            (job_a, 1, "signature"),  # another device's key
            (job_a, 1, "signature"),  # no signature at all
            (job_a, 1, "malformed"),  # flipped byte: SHA-256 mismatch
            (job_a, 1, "signature"),  # flipped byte, SHA-256 redone
            (job_a, 1, "malformed"),  # undecodable
            (job_a, 1, "replay"),  # the same nonce again
            (job_a, 1, "stale"),  # round 1's upload in round 2
            (job_a, 2, "signature"),  # round 1's upload aimed at round 2
            (job_b, 1, "signature"),  # job A's upload aimed at job B
        ]
        assert [(e.job_id, e.round, e.reason) for e in sink.seen] == expected
        recorded = await fed.federation.list_refusals(device_id=me.record.id)
        assert [(r.job_id, r.round, r.reason) for r in reversed(recorded)] == expected
        assert "nonce was already used" in recorded[3].detail
        rounds = (await fed.status(job_a, rounds=True))["rounds"]
        assert [len(r["participants"]) for r in rounds] == [1, 1], "each round took one update"


async def test_a_device_without_a_key_is_told_to_enrol_again(
    db_url: str, digits_spec: Path, tmp_path: Path
) -> None:
    async with in_process_federation(tmp_path / "state", db_url) as fed:
        profile = DeviceProfile("", tasks=(DIGITS,), gflops=1.0)
        credential = await fed.federation.enrol(await fed.enrol_token(), profile)
        record = await fed.federation.authenticate_device(credential.device_id, credential.secret)
        old = HandDevice(fed, record, profile, DeviceIdentity.generate())
        job = await fed.submit(
            digits_spec, "job.rounds=1", "job.clients_per_round=1", "job.min_quorum=1"
        )
        task = await old.task_of(job, 60)
        good = delta(task, fill=0.01)
        with pytest.raises(AuthError, match="enrol again"):
            await send(old, old.signed(header_for(task, good)), good)
        with pytest.raises(AuthError, match="enrol again"):
            await fed.federation.reserve_upload(record, task.order.ref, len(good))
        recorded = await fed.federation.list_refusals(device_id=record.id)
        assert [r.reason for r in recorded] == ["no_key", "no_key"]


async def test_a_revoked_device_is_refused_at_once_and_its_upload_under_way_too(
    db_url: str, digits_spec: Path, tmp_path: Path
) -> None:
    async with in_process_federation(tmp_path / "state", db_url) as fed:
        me = await HandDevice.enrol(fed)
        job = await fed.submit(
            digits_spec, "job.rounds=1", "job.clients_per_round=1", "job.min_quorum=1"
        )
        task = await me.task_of(job, 60)
        good = delta(task, fill=0.01)
        half = len(good) // 2
        resume = asyncio.Event()

        async def slowly() -> AsyncIterator[bytes]:
            yield good[:half]
            await resume.wait()
            yield good[half:]

        header = me.signed(header_for(task, good))
        upload = asyncio.ensure_future(fed.federation.submit_update(me.record, header, slowly()))
        await asyncio.sleep(0.2)  # under way: its header and half its bytes are in
        revoked = await fed.federation.revoke_device(me.record.id)
        assert revoked.revoked_at is not None
        resume.set()
        with pytest.raises(ForbiddenError, match="revoked while its update was uploading"):
            await upload
        # Its next poll (and every other call) is refused, on every edge alike.
        with pytest.raises(ForbiddenError, match="revoked by the operator"):
            await fed.federation.authenticate_device(me.record.id, me.secret)
        # The round gave its slot up with reason "revoked", and the device shows as revoked.
        listed = {d["id"]: d for d in await fed.devices()}
        assert listed[me.record.id]["state"] == "revoked"
        recorded = await fed.federation.list_refusals(device_id=me.record.id)
        assert [r.reason for r in recorded] == ["revoked"]
        assert fed.federation.device_failures()[me.record.id] == {"revoked": 1}
        await fed.federation.cancel_job(job)
        again = await fed.federation.revoke_device(me.record.id)
        assert again.revoked_at == revoked.revoked_at, "revoking twice keeps the first time"
