"""Jobs on a real fleet: submission, one JobRunner per job, cancellation, resumption."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from flotilla.core.eligibility import EligibilitySection
from flotilla.core.errors import (
    FlotillaError,
    LeaseLost,
    NotFoundError,
    SpecError,
    StorageUnavailable,
    TaskLoadError,
)
from flotilla.core.events import EventSink, Fanout, JobChanged
from flotilla.core.records import RESUMABLE_STATES, JobRecord
from flotilla.core.spec import JobSpec
from flotilla.core.timeouts import Timeouts
from flotilla.engine import (
    EngineServices,
    TaskRuntime,
    build_runner,
    job_selector,
    selection_rng,
    submitted_job,
    validate_spec,
)
from flotilla.scheduling import Selector
from flotilla.server.federation.ports import require_p2p
from flotilla.server.federation.store import Store

log = logging.getLogger(__name__)

#: The first pause after a storage outage stopped a job; each further failure doubles it.
OUTAGE_FIRST_DELAY_S = 0.5
#: Finished jobs whose scheduling lessons (tuner trials) a starting server reads back.
LESSONS_FROM_JOBS = 100


class Jobs:
    """Owns one running task per unfinished job; the store is the record of truth."""

    def __init__(
        self,
        services: EngineServices,
        store: Store,
        tasks: TaskRuntime,
        state_dir: Path,
        outage_max_s: float = Timeouts().outage_backoff_max_s,
        holds: Callable[[str], bool] = lambda job_id: True,
        claim: Callable[[str], Awaitable[bool]] | None = None,
    ) -> None:
        """Job state changes the runners do not make (submitted, failed, cancelled) go to
        ``services.events``, as the runners' own do. ``holds`` says whether a job runs in
        this process (its lease, ``federation.placement``); ``claim`` takes a just-submitted
        one if this process should run it."""
        self._events: EventSink = Fanout((services.events,))
        self._services = services
        self._store = store
        self._tasks = tasks
        self._state_dir = state_dir
        self._outage_max_s = outage_max_s
        self._holds = holds
        self._claim = claim
        self._runners: dict[str, asyncio.Task[None]] = {}
        #: Running jobs' task and ``[eligibility]``, for device listings.
        self._policies: dict[str, tuple[str, EligibilitySection]] = {}

    async def sync(self, held: frozenset[str]) -> None:
        """Run exactly the jobs this process holds: stop the runners of the others (given
        back, taken over, or cancelled elsewhere: a round in flight is lost, never half
        committed; one whose job just completed or failed ends by itself) and start one
        for every unfinished job held that has none (left by an earlier run of the server,
        submitted through another server, or taken over)."""
        for job_id in [j for j in self._runners if j not in held]:
            job = await self._store.get_job(job_id)
            if job is None or job.state in RESUMABLE_STATES or job.state == "cancelled":
                await self._stop_runner(job_id)
        if not held - self._runners.keys():
            return
        for job in await self._store.jobs_to_resume():
            if job.id in held:
                self._start_runner(job)

    async def recall_lessons(self, most: int = LESSONS_FROM_JOBS) -> int:
        """Put back what the ``most`` latest finished jobs taught the tuners (their knob
        trials, committed with their last round), so a restarted server's new jobs start
        from them; unfinished jobs bring theirs back when they resume. Returns how many
        jobs taught something."""
        finished = [
            j
            for j in await self._store.list_jobs()
            if j.state not in RESUMABLE_STATES and j.scheduler_sha256
        ]
        finished.sort(key=lambda j: (j.created_at, j.id))
        history = self._services.leases.pool.history
        taught = 0
        for job in finished[-most:]:
            try:
                raw = await asyncio.to_thread(self._services.blobs.get, job.scheduler_sha256)
                history.restore_trials(job.id, json.loads(raw)["history"])
            except (OSError, KeyError, TypeError, ValueError) as exc:
                log.warning("job %s: its scheduling state is unreadable: %s", job.id, exc)
                continue
            taught += bool(history.trials.get(job.id))
        return taught

    async def stop(self) -> None:
        """Cancel every runner and wait for it (the store keeps what they committed)."""
        runners = list(self._runners.values())
        for task in runners:
            task.cancel()
        for task in runners:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _stop_runner(self, job_id: str) -> None:
        runner = self._runners.pop(job_id, None)
        if runner is not None:
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await runner

    async def get(self, job_id: str) -> JobRecord:
        job = await self._store.get_job(job_id)
        if job is None:
            raise NotFoundError(f"unknown job {job_id!r}")
        return job

    def policies(self) -> Mapping[str, tuple[str, EligibilitySection]]:
        """Each running job's task and eligibility policy."""
        return dict(self._policies)

    async def policy(self, job_id: str) -> tuple[str, EligibilitySection]:
        """A job's task and eligibility policy (NotFoundError for an unknown job)."""
        job = await self.get(job_id)
        spec = JobSpec.from_json(job.spec_json, f"job {job.id}")
        return spec.job.task, spec.eligibility

    def _selector(self, spec: JobSpec) -> Selector:
        """Selection seeded from ``job.seed`` (core/spec.py), as the simulator seeds it."""
        return job_selector(spec, self._services.leases.pool, selection_rng(spec.job.seed))

    async def submit_job(self, spec_json: str) -> JobRecord:
        spec = JobSpec.from_json(spec_json, "submitted spec")
        validate_spec(spec)
        if spec.aggregation.transport == "p2p":
            require_p2p()
        self._selector(spec)  # e.g. an rl policy_file that is missing: refused now
        job_id = "job-" + uuid.uuid4().hex[:10]
        blobs, clock = self._services.blobs, self._services.clock
        try:
            job, size = await asyncio.to_thread(
                submitted_job, job_id, spec, blobs, self._tasks, clock()
            )
        except TaskLoadError as exc:
            raise SpecError(f"job.task: {exc}") from exc
        await self._store.add_checkpoint(job.checkpoint_sha256, size)
        await self._store.add_job(job)
        self._events.emit(JobChanged(job.id, job.state))
        if self._claim is None or await self._claim(job.id):
            self._start_runner(job)
        return job

    async def cancel_job(self, job_id: str) -> JobRecord:
        before = await self.get(job_id)
        await self._stop_runner(job_id)
        job = await self._store.set_job_state(job_id, "cancelled")
        if before.state != job.state:
            self._events.emit(JobChanged(job.id, job.state))
        return job

    async def _fail(self, job_id: str) -> None:
        current = await self._store.get_job(job_id)
        if current is not None and not current.terminal:
            await self._store.set_job_state(job_id, "failed")
            self._events.emit(JobChanged(job_id, "failed"))

    async def _after_outage(self, job_id: str, exc: StorageUnavailable, outages: int) -> JobRecord:
        """Wait (doubling, up to ``Timeouts.outage_backoff_max_s``) until the store answers
        again; the job as it now stands. Its round in flight is lost, never half-committed:
        the runner starts again from the last round the store committed, so a commit whose
        answer the outage swallowed is not repeated."""
        delay = min(self._outage_max_s, OUTAGE_FIRST_DELAY_S * 2 ** (outages - 1))
        while True:
            log.warning(
                "job %s paused: %s; resuming from its last committed round in %.1fs",
                job_id, exc, delay,
            )  # fmt: skip
            await asyncio.sleep(delay)
            try:
                return await self.get(job_id)
            except StorageUnavailable as again:
                exc, delay = again, min(self._outage_max_s, delay * 2)

    def _start_runner(self, job: JobRecord) -> None:
        """Run ``job`` here, unless it runs already or another server holds it."""
        if job.id in self._runners or not self._holds(job.id):
            return
        task = asyncio.ensure_future(self._run_job(job))
        self._runners[job.id] = task

    async def _run_job(self, job: JobRecord) -> None:
        job_id = job.id
        try:
            spec = JobSpec.from_json(job.spec_json, f"job {job.id}")
            self._policies[job_id] = (spec.job.task, spec.eligibility)
            # Importing a task (torch, data) takes seconds: keep it off the event loop.
            evaluator = await asyncio.to_thread(self._tasks.evaluator, spec)
            spool = self._state_dir / "spool" / job.id
            outages = 0
            while job.state in RESUMABLE_STATES:
                try:
                    rng = selection_rng(spec.job.seed)
                    await build_runner(job, spec, self._services, rng, evaluator, spool).run()
                    return
                except StorageUnavailable as exc:
                    outages += 1
                    job = await self._after_outage(job_id, exc, outages)
        except asyncio.CancelledError:
            raise
        except LeaseLost as exc:
            log.warning("job %s stopped here: %s", job_id, exc)
        except FlotillaError as exc:
            log.error("job %s stopped: %s", job_id, exc)
            with contextlib.suppress(Exception):
                await self._fail(job_id)
        except Exception:
            log.exception("job %s failed", job_id)
            with contextlib.suppress(Exception):
                await self._fail(job_id)
        finally:
            self._runners.pop(job_id, None)
            self._policies.pop(job_id, None)
