"""Jobs on a real fleet: submission, one JobRunner per job, cancellation, resumption."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from flotilla.core.blobstore import BlobStore
from flotilla.core.errors import FlotillaError, NotFoundError, SpecError, TaskLoadError
from flotilla.core.records import JobRecord
from flotilla.core.spec import JobSpec
from flotilla.engine import EngineConfig, JobRunner, validate_spec
from flotilla.engine.evaluation import initial_model, server_evaluator
from flotilla.scheduling import Arbiter, DevicePool, Selector, make_selector
from flotilla.server.federation.gateway import Gateway
from flotilla.server.federation.ports import Rendezvous, require_p2p
from flotilla.server.federation.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class JobsConfig:
    """What runners are built with: the engine's settings and where robust rules spool."""

    engine: EngineConfig
    state_dir: Path


class Jobs:
    """Owns one running task per unfinished job; the store is the record of truth."""

    def __init__(
        self,
        config: JobsConfig,
        store: Store,
        blobs: BlobStore,
        pool: DevicePool,
        gateway: Gateway,
        arbiter: Arbiter,
        rendezvous: Rendezvous,
    ) -> None:
        self.config = config
        self.state_dir = config.state_dir
        self.store = store
        self.blobs = blobs
        self.pool = pool
        self.gateway = gateway
        self.arbiter = arbiter
        self.rendezvous = rendezvous
        self._runners: dict[str, asyncio.Task[None]] = {}
        self._rng = random.Random()

    async def resume(self) -> None:
        """Start a runner for every job a previous run of the server left unfinished."""
        for job in await self.store.jobs_to_resume():
            self._start_runner(job)

    async def stop(self) -> None:
        """Cancel every runner and wait for it (the store keeps what they committed)."""
        runners = list(self._runners.values())
        for task in runners:
            task.cancel()
        for task in runners:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def get(self, job_id: str) -> JobRecord:
        job = await self.store.get_job(job_id)
        if job is None:
            raise NotFoundError(f"unknown job {job_id!r}")
        return job

    # Moved verbatim from FederationServer (app.py): _selector, submit_job, _start_runner and
    # _run_job, so that changes made there to the runner's construction replay here.

    def _selector(self, spec: JobSpec) -> Selector:
        return make_selector(
            spec.scheduling,
            self.pool,
            random.Random(self._rng.random()),
            spec.job.round_deadline_s,
            spec.job.rounds,
        )

    async def submit_job(self, spec_json: str) -> JobRecord:
        spec = JobSpec.from_json(spec_json, "submitted spec")
        validate_spec(spec)
        if spec.aggregation.transport == "p2p":
            require_p2p()
        self._selector(spec)  # e.g. an rl policy_file that is missing: refused now
        try:
            model_bytes = await asyncio.to_thread(initial_model, spec)
        except TaskLoadError as exc:
            raise SpecError(f"job.task: {exc}") from exc
        sha = await asyncio.to_thread(self.blobs.put, model_bytes)
        await self.store.add_checkpoint(sha, len(model_bytes))
        job = JobRecord.submitted(
            "job-" + uuid.uuid4().hex[:10],
            spec.job.name,
            spec.to_json(),
            spec.job.rounds,
            sha,
            time.time(),
        )
        await self.store.add_job(job)
        self._start_runner(job)
        return job

    async def cancel_job(self, job_id: str) -> JobRecord:
        await self.get(job_id)
        runner = self._runners.pop(job_id, None)
        if runner is not None:
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await runner
        return await self.store.set_job_state(job_id, "cancelled")

    def _start_runner(self, job: JobRecord) -> None:
        spec = JobSpec.from_json(job.spec_json, f"job {job.id}")
        runner = JobRunner(
            job=job,
            spec=spec,
            backend=self.gateway,
            pool=self.pool,
            selector=self._selector(spec),
            ledger=self.store,
            blobs=self.blobs,
            evaluator=None,
            clock=time.time,
            config=self.config.engine,
            spool_dir=self.state_dir / "spool" / job.id,
            arbiter=self.arbiter,
            rendezvous=self.rendezvous.peers,
            p2p_members=self.rendezvous.members,
        )
        task = asyncio.ensure_future(self._run_job(runner))
        self._runners[job.id] = task

    async def _run_job(self, runner: JobRunner) -> None:
        job_id = runner.job.id
        try:
            # Importing a task (torch, data) takes seconds: keep it off the event loop.
            runner.evaluator = await asyncio.to_thread(server_evaluator, runner.spec)
            await runner.run()
        except asyncio.CancelledError:
            raise
        except FlotillaError as exc:
            log.error("job %s stopped: %s", job_id, exc)
            with contextlib.suppress(Exception):
                job = await self.store.get_job(job_id)
                if job is not None and not job.terminal:
                    await self.store.set_job_state(job_id, "failed")
        except Exception:
            log.exception("job %s failed", job_id)
            with contextlib.suppress(Exception):
                await self.store.set_job_state(job_id, "failed")
        finally:
            self._runners.pop(job_id, None)
