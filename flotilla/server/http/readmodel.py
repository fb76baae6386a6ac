"""The dashboard's :class:`ReadModel` over a live :class:`Federation`.

Reads must stay fast with a thousand devices and jobs of a thousand rounds, on the loop
that also serves the fleet: committed rounds never change, so each job's rounds are read
from the store once and then only the new ones (the feed marks a job whose round
committed); the read app caches the rendered answers on top.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from flotilla.core.errors import NotFoundError
from flotilla.core.events import Event, JobChanged, RoundCommitted
from flotilla.core.records import JobRecord, RoundRecord
from flotilla.core.spec import JobSpec
from flotilla.dashboard.model import (
    DeviceStatus,
    FailureView,
    JobView,
    ParticipantView,
    ReadModel,
    RoundView,
    VolunteerRunView,
)
from flotilla.server.federation.facade import Federation
from flotilla.server.federation.views import DeviceInfo, VolunteerRunInfo
from flotilla.server.http.feed import LiveFeed

log = logging.getLogger(__name__)

#: Device classes by measured matmul GFLOPS (``core.measure``): phones and boards,
#: ordinary CPUs, machines with an accelerator or many cores.
CLASS_BOUNDS: tuple[tuple[float, str], ...] = ((10.0, "light"), (200.0, "cpu"))
TOP_CLASS = "accelerated"


def device_class(gflops: float) -> str:
    """The class the dashboard filters and counts a device by, from its profile."""
    if gflops <= 0.0:
        return "unknown"
    for bound, name in CLASS_BOUNDS:
        if gflops < bound:
            return name
    return TOP_CLASS


def job_view(job: JobRecord, task: str) -> JobView:
    return JobView(
        id=job.id,
        name=job.name,
        state=job.state,
        task=task,
        rounds_committed=job.rounds_committed,
        rounds_total=job.rounds_total,
        metrics=dict(job.metrics),
        created_at=job.created_at,
        updated_at=job.updated_at,
    )


def round_view(r: RoundRecord, classes: Mapping[str, str]) -> RoundView:
    a = r.account
    return RoundView(
        round=r.round,
        metrics=dict(r.metrics),
        participants=tuple(p.device_id for p in r.participants),
        devices=tuple(
            ParticipantView(
                p.device_id, p.num_samples, dict(p.metrics), classes.get(p.device_id, "")
            )
            for p in r.participants
        ),
        started_at=r.started_at,
        committed_at=r.committed_at,
        checkpoint_sha256=r.checkpoint_sha256,
        selected=a.selected,
        failures=tuple(FailureView(f.device_id, f.reason) for f in a.failures),
        stale=a.stale,
        bytes_up=a.bytes_up,
        bytes_down=a.bytes_down,
        decisions=a.decisions,
    )


def device_status(info: DeviceInfo, failures: Mapping[str, int]) -> DeviceStatus:
    return DeviceStatus(
        id=info.id,
        state=info.state,
        job=info.job_id,
        device_class=device_class(info.gflops),
        tasks=info.tasks,
        gflops=info.gflops,
        upload_bytes_per_s=info.upload_bytes_per_s,
        last_seen=info.last_seen,
        rounds_served=sum(info.delivered.values()),
        failures=dict(failures),
        ineligible_reason=info.reason if info.state == "ineligible" else "",
        samples=dict(info.samples),
    )


def volunteer_view(info: VolunteerRunInfo) -> VolunteerRunView:
    """A hosted run from its coordinator's ``status.json`` (zeros before it wrote one).
    ``loss_history`` points are ``(epoch, loss)``: the coordinator counts epochs."""
    try:
        status = json.loads(info.status_json) if info.status_json else {}
    except ValueError:
        status = {}
    history = tuple(
        (float(p[0]), float(p[1]))
        for p in status.get("loss_history", ())
        if isinstance(p, list) and len(p) == 2
    )
    return VolunteerRunView(
        run=info.run,
        task=info.task,
        peers_online=int(status.get("peers_online", 0)),
        samples_per_s=float(status.get("samples_per_second", 0.0)),
        loss_history=history,
        maddrs=info.maddrs,
    )


class LiveJobs:
    """Jobs from the store, listed once and then kept up to date from the events: a commit
    carries its job's new row, and only a job that changed otherwise (submitted, started,
    cancelled) is read again, by key. Each job's rounds are kept once read and topped up
    as they commit. The jobs list is read after every round, on the loop that also serves
    the fleet, where every database round trip waits for the loop's other work."""

    def __init__(self, federation: Federation, fleet: LiveFleet, max_jobs: int = 64) -> None:
        self._federation = federation
        self._fleet = fleet
        self._tasks: dict[str, str] = {}
        #: Every job (jobs are never deleted), once listed; None until then.
        self._views: dict[str, JobView] | None = None
        #: Jobs whose row changed without the event carrying it; read again on next use.
        self._changed: set[str] = set()
        self._listing = asyncio.Lock()
        self._rounds: OrderedDict[str, tuple[RoundView, ...]] = OrderedDict()
        self._stale: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        self._max_jobs = max_jobs

    def seen(self, event: Event) -> None:
        """A feed hook, inside ``emit``, before any page hears of the change."""
        if isinstance(event, RoundCommitted):
            self._stale.add(event.job_id)
            if self._views is None:  # not listed yet, or a listing under way predates it
                self._changed.add(event.job_id)
            else:
                self._keep(event.job)
        elif isinstance(event, JobChanged):
            self._stale.add(event.job_id)
            self._changed.add(event.job_id)

    def _keep(self, job: JobRecord) -> None:
        assert self._views is not None
        old = self._views.get(job.id)
        if old is not None and old.updated_at > job.updated_at:
            return  # a read that started before a later commit: keep the later row
        self._views[job.id] = job_view(job, self._task(job))
        if old is None:  # a new job: keep the order the store lists them in
            ordered = sorted(self._views.values(), key=lambda v: (v.created_at, v.id))
            self._views = {v.id: v for v in ordered}

    async def jobs(self) -> Sequence[JobView]:
        """All jobs, oldest first."""
        async with self._listing:
            if self._views is None:
                self._changed.clear()
                listed = await self._federation.list_jobs()
                self._views = {j.id: job_view(j, self._task(j)) for j in listed}
            while self._changed:
                job_id = self._changed.pop()  # a change meanwhile adds it again
                try:
                    self._keep((await self._federation.get_job(job_id)).job)
                except NotFoundError:  # an event names no job the store has: nothing to show
                    continue
            return list(self._views.values())

    def _task(self, job: JobRecord) -> str:
        task = self._tasks.get(job.id)
        if task is None:
            task = self._tasks[job.id] = JobSpec.from_json(job.spec_json).job.task
        return task

    async def rounds(self, job_id: str) -> Sequence[RoundView]:
        cached = self._rounds.get(job_id)
        if cached is not None and job_id not in self._stale:
            self._rounds.move_to_end(job_id)
            return cached
        async with self._locks.setdefault(job_id, asyncio.Lock()):
            cached = self._rounds.get(job_id, ())
            if job_id in self._rounds and job_id not in self._stale:
                return cached
            self._stale.discard(job_id)  # a commit from now on marks it again
            after = cached[-1].round if cached else 0
            try:
                records = await self._federation.list_rounds(job_id, after)
            except NotFoundError:  # keep no lock for an id that names no job
                self._locks.pop(job_id, None)
                raise
            classes = await self._fleet.classes(
                {p.device_id for r in records for p in r.participants}
            )
            rounds = cached + tuple(round_view(r, classes) for r in records)
            self._rounds[job_id] = rounds
            self._rounds.move_to_end(job_id)
            while len(self._rounds) > self._max_jobs:
                evicted, _ = self._rounds.popitem(last=False)
                self._locks.pop(evicted, None)
            return rounds


class LiveFleet:
    """Devices (the pool's view, the store's profiles, failures since start) and the
    volunteer runs this server hosts."""

    def __init__(self, federation: Federation, refresh_s: float = 5.0) -> None:
        self._federation = federation
        self._classes: dict[str, str] = {}
        self._read_at = -refresh_s
        self._refresh_s = refresh_s
        #: Ids a round named that the last listing did not have.
        self._missing: set[str] = set()

    async def devices(self) -> Sequence[DeviceStatus]:
        infos = await self._federation.list_devices()
        failures = self._federation.device_failures()
        out = [device_status(i, failures.get(i.id, {})) for i in infos]
        self._classes = {d.id: d.device_class for d in out}
        self._read_at = time.monotonic()
        return out

    async def classes(self, device_ids: set[str]) -> Mapping[str, str]:
        """Device id -> class for the given devices, read afresh when one is new. A round
        may name a device no longer enrolled: such an id is looked for again only after
        ``refresh_s``, so it does not cost a listing per round."""
        unknown = device_ids - self._classes.keys()
        stale = time.monotonic() - self._read_at >= self._refresh_s
        if unknown - self._missing or (unknown and stale):
            await self.devices()
            self._missing = unknown - self._classes.keys()
        return self._classes

    async def volunteer_runs(self) -> Sequence[VolunteerRunView]:
        return [volunteer_view(i) for i in self._federation.volunteer_runs()]


def live_read_model(federation: Federation, feed: LiveFeed) -> ReadModel:
    """The read model of a running server; ``feed`` must be among its event sinks."""
    fleet = LiveFleet(federation)
    jobs = LiveJobs(federation, fleet)
    feed.on_event(jobs.seen)
    return ReadModel(jobs=jobs, fleet=fleet, changes=feed)
