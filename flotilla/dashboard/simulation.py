"""The read model over a simulation's output directory, for ``flotilla dashboard DIR``.

``flotilla simulate`` writes ``jobs.json`` at its start, a ``metrics.jsonl`` row (with the
round's account) and the round's ``participation.jsonl`` rows as each round commits, and
``summary.json`` at its end. This source follows those files while they grow, so a
researcher watches an experiment through the same views an operator watches a federation.

Nothing runs in the background: whoever reads (a route, an event subscriber) reads what
was appended since the last read, at most once per ``poll_s``. The files tell who served
which round, not who was online: a device is ``busy`` while it is selected for the latest
round of a running job, ``idle`` otherwise, and every device is ``offline`` once the run
has ended.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flotilla.core.errors import NotFoundError
from flotilla.dashboard.model import (
    Change,
    DeviceStatus,
    FailureView,
    JobView,
    ParticipantView,
    ReadModel,
    RoundView,
    VolunteerRunView,
)
from flotilla.dashboard.tail import JsonFile, JsonlTail, Tailed

log = logging.getLogger(__name__)

#: Keys of a ``metrics.jsonl`` row that are not the round's metrics.
_ROW_KEYS = frozenset(
    {
        "job", "job_id", "round", "simulated_time", "round_seconds", "selected", "failures",
        "stale", "bytes_up", "bytes_down", "decisions", "participants", "dropouts",
    }
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Read:
    """Everything one poll of the directory found."""

    jobs: tuple[bool, dict[str, Any] | None]
    metrics: Tailed
    participation: Tailed
    summary: tuple[bool, dict[str, Any] | None]


@dataclass
class _Job:
    id: str
    name: str
    task: str = ""
    rounds_total: int = 0
    created_at: float = 0.0
    #: ``summary.json``'s state for the job, once the run has ended.
    final_state: str = ""
    #: Rows whose participants are all read, in round order; then rows still waiting.
    shown: list[dict[str, Any]] = field(default_factory=list)
    waiting: list[dict[str, Any]] = field(default_factory=list)

    def state(self, ended: bool) -> str:
        if self.final_state:
            return self.final_state
        if self.rounds_total and len(self.shown) >= self.rounds_total:
            return "completed"
        if ended:
            return "failed"  # the summary does not name it
        return "running" if self.shown else "pending"


@dataclass
class _Device:
    device_class: str = ""
    rounds_served: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    last_seen: float = 0.0


class _Run:
    """What the files have said so far; ``apply`` folds in one poll and says what changed."""

    def __init__(self) -> None:
        self.jobs: dict[str, _Job] = {}
        self.devices: dict[str, _Device] = {}
        self.ended = False
        self._served: dict[tuple[str, int], list[dict[str, Any]]] = {}

    def apply(self, read: _Read) -> set[Change]:
        changes: set[Change] = set()
        if read.jobs[0] and read.jobs[1] is not None:
            changes |= self._declare(read.jobs[1].get("jobs", ()))
        for row in read.metrics.rows:
            if _well_formed(row, _ROUND_FIELDS):
                changes |= self._round(row)
        for row in read.participation.rows:
            if _well_formed(row, _SERVED_FIELDS):
                self._served_row(row)
                changes.add(Change("devices"))
        changes |= self._promote()
        if read.summary[0]:
            changes |= self._summary(read.summary[1])
        return changes

    def _job(self, job_id: str, name: str) -> _Job:
        job = self.jobs.get(job_id)
        if job is None:
            job = self.jobs[job_id] = _Job(job_id, name)
        return job

    def _declare(self, rows: Iterable[Any]) -> set[Change]:
        changes = set()
        for row in rows:
            if isinstance(row, dict) and "id" in row:
                job = self._job(str(row["id"]), str(row.get("name", row["id"])))
                job.task = str(row.get("task", ""))
                job.rounds_total = int(row.get("rounds_total", 0))
                job.created_at = float(row.get("created_at", 0.0))
                changes.add(Change("job", job.id))
        return changes

    def _round(self, row: dict[str, Any]) -> set[Change]:
        name = str(row["job"])
        job = self._job(str(row.get("job_id", name)), name)
        job.waiting.append(row)
        t = float(row.get("simulated_time", 0.0))
        for failure in row.get("failures", ()):
            device = self.devices.setdefault(str(failure["device_id"]), _Device())
            device.failures[str(failure["reason"])] += 1
            device.last_seen = max(device.last_seen, t)
        for device_id in row.get("selected", ()):
            self.devices.setdefault(str(device_id), _Device())
        return {Change("devices")}

    def _served_row(self, row: dict[str, Any]) -> None:
        key = (str(row.get("job", "")), int(row.get("round", 0)))
        self._served.setdefault(key, []).append(row)
        device = self.devices.setdefault(str(row.get("device", "")), _Device())
        device.rounds_served += 1
        device.device_class = str(row.get("device_class", "")) or device.device_class
        device.last_seen = max(device.last_seen, float(row.get("finished_at", 0.0)))

    def _promote(self) -> set[Change]:
        """Show each job's next rounds once all their participants are read (the rows
        follow their round's row), so a page fetching ``?since=N`` never misses one."""
        changes = set()
        for job in self.jobs.values():
            while job.waiting and (self.ended or self._complete(job, job.waiting[0])):
                row = job.waiting.pop(0)
                job.shown.append(row)
                changes.add(Change("job", job.id))
        return changes

    def _complete(self, job: _Job, row: dict[str, Any]) -> bool:
        served = self._served.get((job.name, int(row["round"])), ())
        return len(served) >= int(row.get("participants", 0))

    def _summary(self, summary: dict[str, Any] | None) -> set[Change]:
        self.ended = summary is not None
        finals = summary.get("jobs", {}) if summary is not None else {}
        changes = self._promote() | {Change("devices")}
        for job in self.jobs.values():
            final = finals.get(job.name) if isinstance(finals, dict) else None
            job.final_state = str(final.get("state", "")) if isinstance(final, dict) else ""
            changes.add(Change("job", job.id))
        return changes

    def busy(self) -> dict[str, str]:
        """Devices selected for the latest round of a running job, with that job."""
        if self.ended:
            return {}
        out: dict[str, str] = {}
        for job in self.jobs.values():
            if job.shown and job.state(self.ended) == "running":
                out.update((str(d), job.id) for d in job.shown[-1].get("selected", ()))
        return out

    def participants(self, job: _Job, round_: int) -> Sequence[dict[str, Any]]:
        return self._served.get((job.name, round_), ())


class SimulationSource:
    """A :class:`ReadModel` source over ``directory``, read as ``flotilla simulate`` writes
    it. ``poll_s`` bounds how often the files are read, whoever asks."""

    def __init__(
        self,
        directory: Path,
        *,
        poll_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self._poll_s = poll_s
        self._clock = clock
        self._jobs_file = JsonFile(directory / "jobs.json")
        self._metrics = JsonlTail(directory / "metrics.jsonl")
        self._participation = JsonlTail(directory / "participation.jsonl")
        self._summary = JsonFile(directory / "summary.json")
        self._run = _Run()
        self._lock = asyncio.Lock()
        self._read_at: float | None = None
        self._subscribers: set[_Subscriber] = set()

    def read_model(self) -> ReadModel:
        return ReadModel(jobs=self, fleet=self, changes=self)

    async def refresh(self, force: bool = False) -> set[Change]:
        """Read what was appended (unless read less than ``poll_s`` ago); what changed is
        also queued for every subscriber."""
        async with self._lock:
            now = self._clock()
            if not force and self._read_at is not None and now - self._read_at < self._poll_s:
                return set()
            read = await asyncio.to_thread(self._read_files)
            changes: set[Change] = set()
            if read.metrics.reset or read.participation.reset:
                changes = self._restart()
                read = await asyncio.to_thread(self._read_files)
            self._read_at = self._clock()
            changes |= self._run.apply(read)
        for subscriber in self._subscribers:
            subscriber.pending.update(dict.fromkeys(sorted(changes, key=_order)))
        return changes

    def _restart(self) -> set[Change]:
        """A new run rewrote the files: forget the old one and read everything again."""
        changes = {Change("job", j) for j in self._run.jobs} | {Change("devices")}
        self._run = _Run()
        for followed in (self._jobs_file, self._metrics, self._participation, self._summary):
            followed.restart()
        return changes

    def _read_files(self) -> _Read:
        # Round rows before participation rows: a participant's row is written after its
        # round's, so every participant read has its round read too.
        return _Read(
            self._jobs_file.read(), self._metrics.read(), self._participation.read(),
            self._summary.read(),
        )  # fmt: skip

    async def jobs(self) -> Sequence[JobView]:
        await self.refresh()
        return [self._job_view(job) for job in self._run.jobs.values()]

    def _job_view(self, job: _Job) -> JobView:
        last = job.shown[-1] if job.shown else {}
        return JobView(
            id=job.id,
            name=job.name,
            state=job.state(self._run.ended),
            task=job.task,
            rounds_committed=len(job.shown),
            rounds_total=job.rounds_total,
            metrics=_metrics(last),
            created_at=job.created_at,
            updated_at=float(last.get("simulated_time", job.created_at)),
        )

    async def rounds(self, job_id: str) -> Sequence[RoundView]:
        await self.refresh()
        job = self._run.jobs.get(job_id)
        if job is None:
            raise NotFoundError(f"no job {job_id!r} in {self.directory}: see GET /api/v1/jobs")
        return [self._round_view(job, row) for row in job.shown]

    def _round_view(self, job: _Job, row: dict[str, Any]) -> RoundView:
        served = self._run.participants(job, int(row["round"]))
        committed = float(row.get("simulated_time", 0.0))
        return RoundView(
            round=int(row["round"]),
            metrics=_metrics(row),
            participants=tuple(str(p.get("device", "")) for p in served),
            devices=tuple(_participant(p) for p in served),
            started_at=committed - float(row.get("round_seconds", 0.0)),
            committed_at=committed,
            checkpoint_sha256="",
            selected=tuple(str(d) for d in row.get("selected", ())),
            failures=tuple(
                FailureView(str(f["device_id"]), str(f["reason"])) for f in row.get("failures", ())
            ),
            stale=tuple(str(d) for d in row.get("stale", ())),
            bytes_up=int(row.get("bytes_up", 0)),
            bytes_down=int(row.get("bytes_down", 0)),
            decisions=tuple(str(d) for d in row.get("decisions", ())),
        )

    async def devices(self) -> Sequence[DeviceStatus]:
        await self.refresh()
        run = self._run
        busy = run.busy()
        tasks = {job.id: job.task for job in run.jobs.values()}
        return [
            DeviceStatus(
                id=device_id,
                state="offline" if run.ended else "busy" if device_id in busy else "idle",
                job=busy.get(device_id, ""),
                device_class=device.device_class,
                tasks=tuple(sorted({t for t in tasks.values() if t})),
                gflops=0.0,
                upload_bytes_per_s=0.0,
                last_seen=device.last_seen,
                rounds_served=device.rounds_served,
                failures=dict(device.failures),
            )
            for device_id, device in sorted(run.devices.items())
        ]

    async def volunteer_runs(self) -> Sequence[VolunteerRunView]:
        return []  # a simulation has no volunteer runs

    async def changes(self) -> AsyncIterator[Change]:
        """Changes from now on: each subscriber reads the files at most every ``poll_s``
        (one read serves them all) and gets each distinct change once, however many
        polls it slept through."""
        subscriber = _Subscriber()
        self._subscribers.add(subscriber)
        try:
            while True:
                while subscriber.pending:
                    change = next(iter(subscriber.pending))
                    del subscriber.pending[change]
                    yield change
                await asyncio.sleep(self._poll_s)
                await self.refresh()
        finally:
            self._subscribers.discard(subscriber)


#: What a row must hold to be read (field -> a check of its value); others are skipped.
_ROUND_FIELDS: Mapping[str, Callable[[Any], bool]] = {
    "job": lambda v: isinstance(v, str),
    "round": lambda v: isinstance(v, int),
    "participants": lambda v: isinstance(v, int),
    "failures": lambda v: (
        isinstance(v, list)
        and all(isinstance(f, dict) and "device_id" in f and "reason" in f for f in v)
    ),
    "selected": lambda v: isinstance(v, list),
    "stale": lambda v: isinstance(v, list),
    "simulated_time": lambda v: isinstance(v, int | float),
    "round_seconds": lambda v: isinstance(v, int | float),
}
_SERVED_FIELDS: Mapping[str, Callable[[Any], bool]] = {
    "job": lambda v: isinstance(v, str),
    "round": lambda v: isinstance(v, int),
    "device": lambda v: isinstance(v, str),
    "num_samples": lambda v: isinstance(v, int),
    "finished_at": lambda v: isinstance(v, int | float),
}


def _well_formed(row: Mapping[str, Any], fields: Mapping[str, Callable[[Any], bool]]) -> bool:
    """Whether every field ``row`` has is of the expected kind (missing ones read as
    empty); a row that is not is skipped and logged, never an error on every request."""
    ok = all(check(row[name]) for name, check in fields.items() if name in row)
    ok = ok and "job" in row and "round" in row
    if not ok:
        log.warning("skipped a malformed row: %.200s", row)
    return ok


@dataclass(eq=False)  # hashed by identity: one per subscription
class _Subscriber:
    #: Changes not yet yielded, in arrival order; at most one of each (so it stays small).
    pending: dict[Change, None] = field(default_factory=dict)


def _order(change: Change) -> tuple[str, str]:
    return (change.kind, change.job_id)


def _metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """A row's own metrics: its numbers that are not the round's bookkeeping."""
    return {
        key: float(value)
        for key, value in row.items()
        if key not in _ROW_KEYS
        and not key.startswith("wall")
        and isinstance(value, int | float)
        and not isinstance(value, bool)
    }


def _participant(row: Mapping[str, Any]) -> ParticipantView:
    return ParticipantView(
        device_id=str(row.get("device", "")),
        num_samples=int(row.get("num_samples", 0)),
        metrics={k: float(row[k]) for k in ("bytes_up", "bytes_down") if k in row},
        device_class=str(row.get("device_class", "")),
    )
