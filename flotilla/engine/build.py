"""One way to start a job, shared by the server and the simulator.

Both put the task's round-0 model in blob storage, record the job as submitted and build
its :class:`JobRunner` with a selector whose RNG comes from a seed, so the same spec and
seed select the same devices on a real server and in a simulation.
"""

from __future__ import annotations

import random
from pathlib import Path

from flotilla.core.records import JobRecord
from flotilla.core.spec import JobSpec
from flotilla.engine.ports import Blobs, Evaluator, TaskRuntime
from flotilla.engine.rounds import JobRunner
from flotilla.engine.services import EngineServices
from flotilla.scheduling import DevicePool, Selector, make_selector


def selection_rng(seed: int, index: int = 0) -> random.Random:
    """The RNG a job's selector draws from: the server passes ``job.seed``, a simulation
    its own seed and the job's index in the experiment."""
    return random.Random(seed * 1_000_003 + index)


def job_selector(spec: JobSpec, pool: DevicePool, rng: random.Random) -> Selector:
    """The spec's selector (SpecError for bad parameters, e.g. a missing policy file)."""
    return make_selector(
        spec.scheduling, pool, rng, spec.job.round_deadline_s, spec.job.rounds, spec.job.task
    )


def submitted_job(
    job_id: str, spec: JobSpec, blobs: Blobs, tasks: TaskRuntime, now: float
) -> tuple[JobRecord, int]:
    """The job as submitted, its round-0 checkpoint stored; also the checkpoint's size.
    Imports the task (seconds): servers call it off the event loop."""
    model = tasks.initial_model(spec)
    sha = blobs.put(model)
    job = JobRecord.submitted(job_id, spec.job.name, spec.to_json(), spec.job.rounds, sha, now)
    return job, len(model)


def build_runner(
    job: JobRecord,
    spec: JobSpec,
    services: EngineServices,
    rng: random.Random,
    evaluator: Evaluator | None,
    spool_dir: Path | None,
) -> JobRunner:
    """``job``'s runner on ``services``, selecting with ``rng`` (see :func:`selection_rng`)."""
    selector = job_selector(spec, services.leases.pool, rng)
    return JobRunner(job, spec, services, selector, evaluator, spool_dir)
