"""What happened in a federation, as values: the one stream metrics and live views read.

The engine, the server core and the edges *emit* these; Prometheus counters
(``flotilla.server.metrics``) and the dashboard's live feed (``flotilla.server.http``)
*consume* them. Neither side knows the other, and an emitter never waits on a consumer:
``EventSink.emit`` is synchronous, cheap and must not raise.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from flotilla.core.records import JobRecord

log = logging.getLogger(__name__)

#: Why an update was refused: the bounded label set of ``UpdateRefused.reason`` (and so of
#: the ``reason`` label of ``flotilla_updates_refused_total``).
REFUSAL_REASONS: tuple[str, ...] = (
    #: The round is not open for this device (it closed, moved on, or never chose it).
    "stale",
    #: The upload did not finish before the round's deadline (plus grace).
    "late",
    #: Larger than the model's layout allows.
    "oversized",
    #: Tensors missing, extra, or of the wrong shape or dtype for the model.
    "shape",
    #: NaN or infinity in the update.
    "non_finite",
    #: Unreadable: bad framing, checksum, codec, reservation, sample count, stalled stream.
    "malformed",
    #: Well-formed, but the engine would not take it (round full, refused by the strategy).
    "refused",
    #: Its signature does not verify with the device's registered key over this job,
    #: round, round token, payload SHA-256 and nonce (or it carries none).
    "signature",
    #: Its nonce was seen before from this device in this round: a captured upload resent.
    "replay",
    #: Its device was revoked by the operator (before or while it uploaded).
    "revoked",
    #: Its device registered no public key (enrolled before keys): it must enrol again.
    "no_key",
)

#: Why a selected device delivered nothing usable to a round (``DeviceFailed.reason``).
FAILURE_REASONS: tuple[str, ...] = (
    #: Nothing arrived before the round's deadline.
    "deadline",
    #: Still out when the round closed with enough updates from others (over-selection:
    #: a straggler, or a device that dropped out unseen).
    "cut_off",
    #: The device signed off.
    "left",
    #: The device stopped answering (reaped by the liveness check).
    "silent",
    #: The device polled for new work instead of finishing this round's.
    "abandoned",
    #: Its update was refused by the aggregation strategy.
    "refused",
    #: Its sender stopped waiting for a verdict.
    "gave_up",
    #: Its conditions stopped meeting the job's ``[eligibility]`` mid-round (unplugged,
    #: on a metered network, busy, low battery): a dropout, not a fault of the device.
    "conditions",
    #: The operator revoked the device while the round owed its update.
    "revoked",
    #: A simulated dropout, or a reason the backend gave that fits none of the above.
    "dropped",
)


def failure_reason(text: str) -> str:
    """The bounded label for a backend's free-text failure reason."""
    lowered = text.lower()
    for reason, marks in _FAILURE_MARKS:
        if any(m in lowered for m in marks):
            return reason
    return "dropped"


_FAILURE_MARKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("refused", ("refused",)),
    ("revoked", ("revoked",)),
    ("left", ("left",)),
    ("silent", ("silent",)),
    ("abandoned", ("abandon",)),
    ("deadline", ("deadline", "timed out", "timeout")),
    ("conditions", ("conditions", "charging", "unmetered", "metered", "idle", "battery")),
)


@dataclass(frozen=True, slots=True)
class RoundCommitted:
    """A round's aggregate became the job's model."""

    job_id: str
    round_no: int
    #: From selection to commit.
    duration_s: float
    #: Spent combining the updates (decode, robust rule, optimizer step).
    aggregation_s: float
    participants: int
    #: The job's row as this commit left it (live views show it without a read).
    job: JobRecord


@dataclass(frozen=True, slots=True)
class RoundRetried:
    """A round ended without a commit and will be tried again (no quorum, refused aggregate)."""

    job_id: str
    round_no: int
    reason: str


@dataclass(frozen=True, slots=True)
class UpdateAccepted:
    """An uploaded update the round took (``size_bytes``: its payload on the wire)."""

    job_id: str
    device_id: str
    size_bytes: int


@dataclass(frozen=True, slots=True)
class UpdateRefused:
    """An update the server would not take. ``reason`` is one of :data:`REFUSAL_REASONS`,
    so a metric labelled by it stays bounded; ``job_id`` is empty when the job the device
    named never ran a round here."""

    job_id: str
    device_id: str
    reason: str
    #: The round the upload named (-1: unknown), and the refusal's words, for the record.
    round: int = -1
    detail: str = ""


@dataclass(frozen=True, slots=True)
class DeviceFailed:
    """A device selected for a round delivered nothing usable to it (``reason``: one of
    :data:`FAILURE_REASONS`)."""

    job_id: str
    device_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class BytesSent:
    """Model bytes streamed to a device (``job_id`` empty for an operator's export)."""

    job_id: str
    size_bytes: int


@dataclass(frozen=True, slots=True)
class DeviceChanged:
    """A device enrolled, came back, left, went silent or was revoked (``state``:
    ``enrolled``, ``online``, ``offline``, ``revoked``)."""

    device_id: str
    state: str


@dataclass(frozen=True, slots=True)
class JobChanged:
    """A job was submitted, started, finished, failed or was cancelled (``state`` is its
    new one: ``pending``, ``running``, ``completed``, ``failed``, ``cancelled``)."""

    job_id: str
    state: str


@dataclass(frozen=True, slots=True)
class PollAnswered:
    """A device's poll returned (with work or empty) after ``latency_s``."""

    latency_s: float


@dataclass(frozen=True, slots=True)
class StoreCommitted:
    """A database transaction that commits a round finished after ``latency_s``."""

    latency_s: float


Event = (
    RoundCommitted
    | RoundRetried
    | UpdateAccepted
    | UpdateRefused
    | DeviceFailed
    | BytesSent
    | DeviceChanged
    | JobChanged
    | PollAnswered
    | StoreCommitted
)


class EventSink(Protocol):
    """Takes events as they happen; returns at once and never raises."""

    def emit(self, event: Event) -> None: ...


class NoEvents:
    """The sink of a process nobody watches."""

    def emit(self, event: Event) -> None:
        return None


class Fanout:
    """Hands every event to each of ``sinks`` in turn (metrics, live feed, ...).

    Emitters hold a ``Fanout``, never a bare sink: a sink that raises is logged and
    skipped, so a broken consumer can never fail a round, an upload or a poll.
    """

    def __init__(self, sinks: Iterable[EventSink]) -> None:
        self._sinks = tuple(sinks)

    def emit(self, event: Event) -> None:
        for sink in self._sinks:
            try:
                sink.emit(event)
            except Exception:
                log.exception("event sink %s failed on %s", type(sink).__name__, event)
