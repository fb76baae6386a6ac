"""The event stream metrics and the live feed read: emitted where things happen, in the
order they happen, and never able to break what emits them."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TypeVar

import pytest

from flotilla.core.events import (
    FAILURE_REASONS,
    DeviceChanged,
    DeviceFailed,
    Event,
    Fanout,
    JobChanged,
    PollAnswered,
    RoundCommitted,
    RoundRetried,
    StoreCommitted,
    UpdateAccepted,
    failure_reason,
)
from tests.support.hand_device import HandDevice
from tests.support.inproc import in_process_federation, poll_until

pytestmark = pytest.mark.timeout(300)

E = TypeVar("E")


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def of(self, kind: type[E]) -> list[E]:
        return [e for e in self.events if isinstance(e, kind)]


class Exploding:
    """A consumer with a bug: every event raises."""

    def __init__(self) -> None:
        self.calls = 0

    def emit(self, event: Event) -> None:
        self.calls += 1
        raise RuntimeError("this sink is broken")


def test_a_raising_sink_is_logged_and_the_others_still_hear(
    caplog: pytest.LogCaptureFixture,
) -> None:
    before, after, broken = Recorder(), Recorder(), Exploding()
    fanout = Fanout((before, broken, after))
    event = PollAnswered(0.5)
    with caplog.at_level(logging.ERROR, logger="flotilla.core.events"):
        fanout.emit(event)  # does not raise
    assert before.events == after.events == [event] and broken.calls == 1
    assert "Exploding failed on PollAnswered" in caplog.text


def test_backend_failure_texts_map_to_a_bounded_reason() -> None:
    cases = {
        "left: switched off": "left",
        "went silent": "silent",
        "agent abandoned the task": "abandoned",
        "conditions: not charging": "conditions",
        "reported: network metered, unmetered required": "conditions",
        "dropped out": "dropped",
        "refused: the update contains NaN or Inf": "refused",
        "something new": "dropped",
    }
    assert {text: failure_reason(text) for text in cases} == cases
    assert set(cases.values()) <= set(FAILURE_REASONS)


async def test_a_federation_emits_its_story_and_a_broken_sink_stops_nothing(
    db_url: str, digits_spec: Path, tmp_path: Path
) -> None:
    seen, broken = Recorder(), Exploding()
    async with in_process_federation(tmp_path / "state", db_url, sinks=(broken, seen)) as fed:
        agents = await fed.start_agents(2)
        await fed.wait_devices(2, timeout=60)
        job_id = await fed.submit(digits_spec, "job.rounds=3", "job.clients_per_round=2")
        status = await fed.wait_for(job_id, timeout=180)
        assert status["state"] == "completed", status  # every emit raised in `broken`
        rounds = await fed.store.list_rounds(job_id)
        await fed.stop_agents()
        ids = {a.device_id for a in agents}
    assert broken.calls == len(seen.events) > 0

    jobs = [(e.job_id, e.state) for e in seen.of(JobChanged)]
    assert jobs == [(job_id, "pending"), (job_id, "running"), (job_id, "completed")]
    committed = seen.of(RoundCommitted)
    assert [(e.job_id, e.round_no) for e in committed] == [(job_id, n) for n in (1, 2, 3)]
    for event, record in zip(committed, rounds, strict=True):
        assert event.participants == len(record.participants)
        assert event.duration_s == pytest.approx(record.committed_at - record.started_at)
        assert 0 <= event.aggregation_s < event.duration_s
    assert len(seen.of(StoreCommitted)) == 3
    accepted = seen.of(UpdateAccepted)
    assert len(accepted) == sum(len(r.participants) for r in rounds)
    assert {e.device_id for e in accepted} == ids
    assert seen.of(PollAnswered)

    # Each agent enrolled, came online with its first poll and went offline on leaving.
    changes = [
        (e.device_id, e.state) for e in seen.of(DeviceChanged) if isinstance(e, DeviceChanged)
    ]
    for device_id in ids:
        mine = [state for d, state in changes if d == device_id]
        assert mine == ["enrolled", "online", "offline"], mine


async def test_a_round_below_quorum_is_retried_and_its_leaver_counted(
    db_url: str, digits_spec: Path, tmp_path: Path
) -> None:
    """Three selected, quorum three, one leaves: the attempt is retried ("quorum"), the
    leaver's failure is on the stream, and cancelling the job is its last change."""
    seen = Recorder()
    async with in_process_federation(tmp_path / "state", db_url, sinks=(seen,)) as fed:
        hand = await HandDevice.enrol(fed)
        assert await fed.federation.poll(hand.record, hand.profile) is None
        await fed.start_agents(2)
        await fed.wait_devices(3, timeout=60)
        job_id = await fed.submit(
            digits_spec, "job.rounds=2", "job.clients_per_round=3", "job.min_quorum=3"
        )
        await hand.task_of(job_id, timeout_s=60)
        fed.federation.leave(hand.record, "battery low")

        async def retried() -> bool:
            return bool(seen.of(RoundRetried))

        assert await poll_until(retried, 60)
        await fed.federation.cancel_job(job_id)
        assert fed.federation.device_failures() == {hand.record.id: {"left": 1}}

    assert seen.of(RoundRetried)[0] == RoundRetried(job_id, 1, "quorum")
    assert DeviceFailed(job_id, hand.record.id, "left") in seen.events
    assert not seen.of(RoundCommitted)
    assert seen.of(JobChanged)[-1] == JobChanged(job_id, "cancelled")
    assert DeviceChanged(hand.record.id, "offline") in seen.events
