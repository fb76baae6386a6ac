"""What happened in a federation, as values: the one stream metrics and live views read.

The engine, the server core and the edges *emit* these; Prometheus counters
(``flotilla.server.metrics``) and the dashboard's live feed (``flotilla.server.http``)
*consume* them. Neither side knows the other, and an emitter never waits on a consumer:
``EventSink.emit`` is synchronous, cheap and must not raise.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


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


@dataclass(frozen=True, slots=True)
class RoundRetried:
    """A round ended without a commit and will be tried again (no quorum, refused aggregate)."""

    job_id: str
    round_no: int
    reason: str


@dataclass(frozen=True, slots=True)
class UpdateAccepted:
    job_id: str
    device_id: str
    size_bytes: int


@dataclass(frozen=True, slots=True)
class UpdateRefused:
    """An update the server would not take. ``reason`` is one of a small fixed set
    (``shape``, ``non_finite``, ``stale``, ``oversized``, ``malformed``, ``late``) so a
    metric labelled by it stays bounded."""

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
    """A device enrolled, came back, left or went silent (``state``: ``online``,
    ``offline``)."""

    device_id: str
    state: str


@dataclass(frozen=True, slots=True)
class JobChanged:
    """A job was submitted, finished, failed or was cancelled (``state`` is its new one)."""

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
    """Hands every event to each of ``sinks`` in turn (metrics, live feed, ...)."""

    def __init__(self, sinks: Iterable[EventSink]) -> None:
        self._sinks = tuple(sinks)

    def emit(self, event: Event) -> None:
        for sink in self._sinks:
            sink.emit(event)
