"""``flotilla simulate``: an experiment's jobs on the real engine over a virtual fleet.

Each job is a real :class:`~flotilla.engine.JobRunner` with the real selector, aggregator
and codecs; the backend is :class:`SimBackend`, the clock the virtual event loop's. The
start writes ``jobs.json`` (the jobs as submitted); every committed round becomes a line of
``metrics.jsonl`` and its participants lines of ``participation.jsonl``, flushed as each
round commits so ``flotilla dashboard DIR`` can follow the run; the end writes
``summary.json``, each job's final model and plots.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

from flotilla.core.blobstore import BlobStore
from flotilla.core.commit_rules import (
    check_commit,
    check_job_state,
    check_next_round,
    check_transition,
    state_after,
)
from flotilla.core.errors import ConflictError, FlotillaError, NotFoundError, SpecError
from flotilla.core.records import JobRecord, RoundCommit
from flotilla.core.spec import JobSpec
from flotilla.engine import (
    EngineConfig,
    EngineServices,
    JobRunner,
    build_runner,
    selection_rng,
    submitted_job,
)
from flotilla.report import JobBars, JobSeries, RoundPoint, write_plots
from flotilla.scheduling import Arbiter, DevicePool, Leases
from flotilla.simulation.backend import SimBackend
from flotilla.simulation.clock import run_simulated
from flotilla.simulation.experiment import Experiment
from flotilla.simulation.fleet import Fleet
from flotilla.simulation.population import draw_devices
from flotilla.simulation.training import ClientTrainer, ShardCache, make_trainer
from flotilla.simulation.workers import WorkerPoolTrainer
from flotilla.tasks.base import importable_from
from flotilla.tasks.runtime import LocalTasks

log = logging.getLogger(__name__)

#: Engine pacing in simulated seconds: polling for idle devices costs wall time per poll.
SIM_ENGINE = EngineConfig(selection_grace_s=2.0, retry_pause_s=1.0, idle_poll_s=1.0)


class LedgerObserver(Protocol):
    """Told of every round the ledger commits (after it is committed)."""

    def committed(self, job: JobRecord, commit: RoundCommit) -> None: ...


class SimLedger:
    """The engine's ledger for a simulation: job rows in memory, with the store's rules.

    A commit is refused (:class:`RoundConflict`, nothing recorded, no observer told) unless
    it is the job's next round and the job is not finished, as :meth:`Store.commit_round`
    refuses it; a finished job never changes state (:class:`JobStateError`).
    """

    def __init__(self, observers: Sequence[LedgerObserver] = ()) -> None:
        self.jobs: dict[str, JobRecord] = {}
        self._observers = tuple(observers)

    def add(self, job: JobRecord) -> None:
        """Record a submitted job; a second job with the same id is a :class:`ConflictError`."""
        check_job_state(job.state)
        if job.id in self.jobs:
            raise ConflictError(f"job {job.id!r} already exists")
        self.jobs[job.id] = job

    def _job(self, job_id: str) -> JobRecord:
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFoundError(f"unknown job {job_id!r}")
        return job

    async def commit_round(self, commit: RoundCommit) -> JobRecord:
        check_commit(commit)
        job = self._job(commit.job_id)
        check_next_round(commit, job.state, job.rounds_committed, job.rounds_total)
        job = dataclasses.replace(
            job,
            state=state_after(commit, job.rounds_total),
            rounds_committed=commit.round,
            checkpoint_sha256=commit.checkpoint_sha256,
            aggregator_sha256=commit.aggregator_sha256,
            scheduler_sha256=commit.scheduler_sha256,
            metrics=dict(commit.metrics),
            updated_at=commit.committed_at,
        )
        self.jobs[job.id] = job
        for observer in self._observers:
            observer.committed(job, commit)
        return job

    async def set_job_state(self, job_id: str, state: str) -> JobRecord:
        check_job_state(state)
        job = self._job(job_id)
        if job.state != state:
            check_transition(job_id, job.state, state)
            job = dataclasses.replace(job, state=state)
            self.jobs[job_id] = job
        return job


class Progress(Protocol):
    """Told of each job's committed rounds (:class:`flotilla.report.JobBars` draws bars)."""

    def update(self, name: str, done: int, **notes: str) -> None: ...

    def close(self) -> None: ...


class RunLog:
    """A simulation's record of committed rounds: ``metrics.jsonl`` (each row with its
    round's account, as a server stores it), ``participation.jsonl``, the rows
    ``summary.json`` and the plots are made of, and the progress shown."""

    def __init__(
        self,
        out: IO[str],
        participation: IO[str],
        dropouts: Mapping[tuple[str, int], int],
        wall_start: float,
        progress: Progress | None = None,
        device_classes: Mapping[str, str] | None = None,
    ) -> None:
        #: Each job's metrics rows, by job id, in commit order.
        self.history: dict[str, list[dict[str, Any]]] = {}
        #: Each job's rounds as the plots draw them, by job name, in commit order.
        self.points: dict[str, list[RoundPoint]] = {}
        self._out = out
        self._participation = participation
        self._dropouts = dropouts
        self._wall_start = wall_start
        self._progress = progress
        self._classes = device_classes or {}

    def committed(self, job: JobRecord, commit: RoundCommit) -> None:
        row = {
            "job": job.name,
            "job_id": job.id,
            "round": commit.round,
            "simulated_time": commit.committed_at,
            "round_seconds": commit.committed_at - commit.started_at,
            **commit.metrics,
            # The round's account (selected, failures, stale, bytes_up, bytes_down,
            # decisions): what `flotilla dashboard DIR` shows on the round timeline.
            **commit.account.to_json(),
            "participants": len(commit.participants),
            "dropouts": self._dropouts.get((job.id, commit.round), 0),
            "wall_seconds": time.perf_counter() - self._wall_start,
        }
        self.history.setdefault(job.id, []).append(row)
        self._out.write(json.dumps(row, sort_keys=True) + "\n")
        self._out.flush()
        classes = tuple(self._classes.get(p.device_id, p.device_id) for p in commit.participants)
        self.points.setdefault(job.name, []).append(
            RoundPoint(
                round=commit.round,
                seconds=commit.committed_at,
                metrics=dict(commit.metrics),
                bytes_up=commit.account.bytes_up,
                bytes_down=commit.account.bytes_down,
                participants=classes,
            )
        )
        for p, device_class in zip(commit.participants, classes, strict=True):
            self._participation.write(
                json.dumps(
                    {
                        "job": job.name,
                        "round": commit.round,
                        "device": p.device_id,
                        "device_class": device_class,
                        "num_samples": p.num_samples,
                        "started_at": p.started_at,
                        "finished_at": p.finished_at,
                        "bytes_up": p.metrics.get("bytes_up", 0.0),
                        "bytes_down": p.metrics.get("bytes_down", 0.0),
                    },
                    sort_keys=True,
                )
                + "\n"
            )
        self._participation.flush()
        if self._progress is not None:
            accuracy = commit.metrics.get("accuracy")
            self._progress.update(
                job.name,
                commit.round,
                sim=format_duration(commit.committed_at),
                accuracy="-" if accuracy is None else f"{accuracy:.3f}",
            )


def run_experiment(
    experiment: Experiment,
    out_dir: Path,
    devices: Sequence[str] = ("cpu",),
    backend: str = "local",
    progress: bool | Progress = True,
    plots: bool = True,
) -> dict[str, Any]:
    """Run every job of ``experiment`` to the end; returns what ``summary.json`` holds.

    ``devices``: where clients train (one worker process per device when there are
    several); ``backend``: ``local`` or ``ray`` (workers as Ray actors); ``progress``:
    True for a bar per job on stderr (a line per round where it is no terminal);
    ``plots``: draw the PNG charts at the end (seconds of matplotlib a study can skip).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    # A summary left by an earlier run in this directory would say this one has ended.
    (out_dir / "summary.json").unlink(missing_ok=True)
    wall_start = time.perf_counter()
    with importable_from(experiment.task_dirs):
        trainers = _trainers(experiment, list(devices), backend)
        try:
            with tempfile.TemporaryDirectory(prefix="flotilla-sim-") as scratch:
                summary = run_simulated(
                    _simulate(
                        experiment, out_dir, Path(scratch), trainers, progress, wall_start, plots
                    )
                )
        finally:
            for trainer in trainers.values():
                close = getattr(trainer, "close", None)
                if close is not None:
                    close()
    summary["wall_seconds"] = time.perf_counter() - wall_start
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


async def _simulate(
    experiment: Experiment,
    out_dir: Path,
    scratch: Path,
    trainers: dict[str, ClientTrainer],
    progress: bool | Progress,
    wall_start: float,
    plots: bool,
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    pop = experiment.population
    seed = experiment.population_seed
    pool = DevicePool(clock=loop.time)
    leases = Leases(pool)
    tasks = tuple(sorted({spec.job.task for spec in experiment.jobs}))
    virtual = draw_devices(pop, seed)
    fleet = Fleet(
        virtual, tasks, pop.availability, seed, leases, _shard_sizes(experiment, trainers)
    )
    blobs = BlobStore(scratch / "blobs")
    backend = SimBackend(fleet, leases, blobs, trainers, pop, experiment.seed, scratch / "clients")
    bar = _progress(experiment, progress)
    with (
        (out_dir / "metrics.jsonl").open("w") as out,
        (out_dir / "participation.jsonl").open("w") as participation,
    ):
        classes = {d.device_id: d.kind for d in virtual}
        run_log = RunLog(out, participation, backend.dropouts, wall_start, bar, classes)
        ledger = SimLedger([run_log])
        joint = experiment.simulation.arbiter == "joint"
        arbiter = Arbiter(
            pool, loop.time, SIM_ENGINE.selection_grace_s, SIM_ENGINE.idle_poll_s, joint=joint
        )
        services = EngineServices(backend, leases, arbiter, ledger, blobs, loop.time, SIM_ENGINE)
        runners = [
            _runner(i, spec, services, ledger, scratch, experiment.seed)
            for i, spec in enumerate(experiment.jobs)
        ]
        _write_jobs(out_dir / "jobs.json", [(r.job, r.spec) for r in runners])
        fleet.start()
        # Everything built so far (torch, the fleet, the data) lives to the end: keep the
        # cyclic collector from rescanning it in every full collection of the run.
        gc.freeze()
        try:
            await asyncio.wait_for(
                asyncio.gather(
                    *(_run_job(r, ledger, experiment.start_s(i)) for i, r in enumerate(runners))
                ),
                timeout=experiment.simulation.max_simulated_s,
            )
        except asyncio.TimeoutError:
            log.warning(
                "stopped at the time limit (%.0f simulated seconds)",
                experiment.simulation.max_simulated_s,
            )
        finally:
            gc.unfreeze()
            fleet.stop()
            if bar is not None:
                bar.close()
    models = out_dir / "models"
    models.mkdir(exist_ok=True)
    summary_jobs: dict[str, dict[str, Any]] = {}
    for runner in runners:
        job = ledger.jobs[runner.job.id]
        (models / f"{job.name}.safetensors").write_bytes(blobs.get(job.checkpoint_sha256))
        learned = runner.selector.state()
        if learned:  # e.g. an rl policy, to start a real job from: scheduling.params.policy_file
            selectors = out_dir / "selectors"
            selectors.mkdir(exist_ok=True)
            (selectors / f"{job.name}.json").write_text(json.dumps(learned))
        history = run_log.history.get(job.id, [])
        summary_jobs[job.name] = {
            "state": job.state,
            "rounds": job.rounds_committed,
            "final_metrics": dict(job.metrics),
            "simulated_seconds": history[-1]["simulated_time"] if history else 0.0,
        }
    if plots:
        series = [JobSeries(name, tuple(points)) for name, points in run_log.points.items()]
        write_plots(series, out_dir, time_label="simulated time")
    finals = [j["final_metrics"] for j in summary_jobs.values()]
    overall = (
        {
            key: sum(f[key] for f in finals) / len(finals)
            for key in set.intersection(*(set(f) for f in finals))
        }
        if finals and all(finals)
        else {}
    )
    return {
        "jobs": summary_jobs,
        "final_metrics": overall,
        "rounds": sum(j["rounds"] for j in summary_jobs.values()),
        "simulated_seconds": max(
            (j["simulated_seconds"] for j in summary_jobs.values()), default=0.0
        ),
        "clients": pop.clients,
        "seed": experiment.seed,
        "trainer": {name: _describe(t) for name, t in trainers.items()},
    }


def _write_jobs(path: Path, jobs: Sequence[tuple[JobRecord, JobSpec]]) -> None:
    """``jobs.json``: the jobs as submitted, so a dashboard lists them before their first
    round; written whole (temporary file, then rename) so a reader never sees half."""
    rows = [
        {
            "id": job.id,
            "name": job.name,
            "task": spec.job.task,
            "rounds_total": job.rounds_total,
            "created_at": job.created_at,
        }
        for job, spec in jobs
    ]
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"jobs": rows}, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


async def _run_job(runner: JobRunner, ledger: SimLedger, start_s: float = 0.0) -> None:
    """One job to its end, from ``start_s`` on the virtual clock; a job that fails is
    recorded as failed, the others go on."""
    if start_s > 0:
        await asyncio.sleep(start_s)
    try:
        await runner.run()
    except FlotillaError as exc:
        log.error("job %s failed: %s", runner.job.name, exc)
        await ledger.set_job_state(runner.job.id, "failed")


def _shard_sizes(
    experiment: Experiment, trainers: Mapping[str, ClientTrainer]
) -> dict[str, list[int]]:
    """Per task, each device's training samples, as devices report them with their
    profile: from the data of the first job on the task (jobs of one task whose data
    differs are told the first one's sizes, as a device holds one data set per task)."""
    sizes: dict[str, list[int]] = {}
    for spec in experiment.jobs:
        task = spec.job.task
        if task not in sizes:
            shards = trainers[task].shards
            sizes[task] = [
                shards.num_train(spec.data, i) for i in range(experiment.population.clients)
            ]
    return sizes


def _trainers(experiment: Experiment, devices: list[str], backend: str) -> dict[str, ClientTrainer]:
    """One trainer per task: in this process on one device, else one worker per device."""
    from flotilla.tasks import load_task

    if backend not in ("local", "ray"):
        raise SpecError(f"--backend must be local or ray, got {backend!r}")
    if not devices:
        raise SpecError("--devices names no device")
    if any(d.startswith("cuda") for d in devices) and backend == "local":
        import torch

        if not torch.cuda.is_available():
            raise SpecError(f"--devices {','.join(devices)}: this machine has no CUDA device")
    choice = experiment.simulation.trainer
    batched = None if choice == "auto" else choice == "batched"
    clients = experiment.population.clients
    trainers: dict[str, ClientTrainer] = {}
    try:
        for name in sorted({spec.job.task for spec in experiment.jobs}):
            task = load_task(name)
            shards = ShardCache(task, clients)
            if backend == "ray":
                from flotilla.simulation.ray_workers import RayTrainer

                trainers[name] = RayTrainer(name, shards, devices, batched, experiment.task_dirs)
            elif len(devices) > 1:
                trainers[name] = WorkerPoolTrainer(name, shards, devices, batched)
            else:
                trainers[name] = make_trainer(task, shards, devices[0], batched)
    except BaseException:
        for trainer in trainers.values():
            getattr(trainer, "close", lambda: None)()
        raise
    return trainers


def _describe(trainer: ClientTrainer) -> str:
    kind = getattr(trainer, "kind", None)
    name = type(trainer).__name__
    out = f"{name}({', '.join(sorted(kind))})" if kind else name
    if isinstance(trainer, WorkerPoolTrainer):
        out += f", {trainer.folded_clients} of {trainer.trained_clients} clients folded"
    return out


def _runner(
    index: int,
    spec: JobSpec,
    services: EngineServices,
    ledger: SimLedger,
    scratch: Path,
    seed: int,
) -> JobRunner:
    """The job's runner, built as the server builds it (selection from the experiment's
    seed and the job's index)."""
    tasks = LocalTasks()
    job, _ = submitted_job(f"job-{index}", spec, services.blobs, tasks, services.clock())
    ledger.add(job)
    rng = selection_rng(seed, index)
    spool = scratch / "spool" / job.id
    return build_runner(job, spec, services, rng, tasks.evaluator(spec), spool)


def format_duration(seconds: float) -> str:
    """Simulated time for people: 42.0s, 12.5min, 3.20h, 2.1d."""
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}min"
    if seconds < 172_800:
        return f"{seconds / 3600:.2f}h"
    return f"{seconds / 86_400:.1f}d"


def _progress(experiment: Experiment, progress: bool | Progress) -> Progress | None:
    if not isinstance(progress, bool):
        return progress
    if not progress:
        return None
    return JobBars({spec.job.name: spec.job.rounds for spec in experiment.jobs})
