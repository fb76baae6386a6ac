"""The virtual fleet as the engine's :class:`~flotilla.engine.Backend`.

A dispatched round trains its devices at once (wall time, no simulated time), then each
result arrives when the device would have finished: compute (samples x epochs x cost per
sample / speed) + download and upload (bytes / bandwidth) + latency each way, on the
virtual clock. A device that drops out mid-round, or whose online session ends first,
never reports; the engine hears of it ``dropout_detect_s`` later, as a real server hears
of a silent agent at its liveness timeout. Updates go through the device-side pipeline
of a real agent (update momentum, the uplink codec with error feedback) and the server's
decode, so compression behaves as on real devices.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flotilla.compression.broadcast import decode_model
from flotilla.core.round_config import RoundConfig
from flotilla.core.tensors import ModelState
from flotilla.core.update import COMPUTE_METRIC, Update
from flotilla.engine.backend import Arrival, Delivered, Failed, Folded, RoundResult, TrainTask
from flotilla.engine.ports import Blobs
from flotilla.scheduling import DeviceEvents
from flotilla.simulation.fleet import Fleet
from flotilla.simulation.folding import DELTAS_IN_FLIGHT_BYTES, FoldingTrainer, FoldRequest
from flotilla.simulation.population import PopulationSection, Slowdowns, VirtualDevice
from flotilla.simulation.training import ClientTrainer
from flotilla.simulation.uplink import SimulatedUplink


@dataclass(frozen=True, slots=True)
class _Planned:
    """A device that will deliver: when, and what its timing needs."""

    arrival: float
    device_id: str
    device: VirtualDevice
    down: int
    jitter: float


@dataclass(slots=True)
class _Round:
    task: TrainTask
    pending: set[str]
    results: asyncio.Queue[RoundResult] = field(default_factory=asyncio.Queue)
    closed: bool = False
    #: Why training failed: the engine's stream raises it, as a failed dispatch would.
    error: Exception | None = None


class _Stream:
    """The engine's view of one round; closing it makes later arrivals stale."""

    def __init__(self, backend: SimBackend, open_round: _Round) -> None:
        self._backend = backend
        self._open_round = open_round

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> RoundResult:
        open_round = self._open_round
        if not open_round.closed and (open_round.pending or not open_round.results.empty()):
            result = await open_round.results.get()
            if open_round.error is not None:
                raise open_round.error
            return result
        await self.aclose()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        open_round = self._open_round
        open_round.closed = True
        while not open_round.results.empty():
            result = open_round.results.get_nowait()
            if isinstance(result, Delivered):
                result.settle("stale: the round closed before this update was aggregated")


@dataclass(slots=True)
class _JobContext:
    config: RoundConfig
    pipeline: SimulatedUplink
    #: Seeds the codec's randomness of every upload of the job (``SimulatedUplink``).
    uplink_seed: int


class SimBackend:
    """Rounds on virtual devices, timed by the virtual clock (see the module doc)."""

    def __init__(
        self,
        fleet: Fleet,
        events: DeviceEvents,
        blobs: Blobs,
        trainers: dict[str, ClientTrainer],
        population: PopulationSection,
        seed: int,
        state_dir: Path,
        deltas_in_flight_bytes: int = DELTAS_IN_FLIGHT_BYTES,
    ) -> None:
        self.fleet = fleet
        self.deltas_in_flight_bytes = deltas_in_flight_bytes

        self.state_dir = state_dir
        #: Told when a device is done with its job (the lease owner frees it).
        self.events = events
        self.blobs = blobs
        self.trainers = trainers
        self.population = population
        self._rng = np.random.default_rng([seed % 2**32, 2])
        self._slow = Slowdowns.draw(population, seed)
        self._slow_active = self._slow.active
        self._noise_rng = np.random.default_rng([seed % 2**32, 6])
        self._seed = seed
        self._jobs: dict[str, _JobContext] = {}
        self._model: tuple[str, ModelState] | None = None
        #: The broadcast each device last received, for downlink-delta byte counts.
        self._held: dict[str, str] = {}
        #: Devices that dropped out, per (job, round).
        self.dropouts: Counter[tuple[str, int]] = Counter()

    def dispatch(self, task: TrainTask, device_ids: Sequence[str]) -> _Stream:
        """Decide each device's fate and arrival now; train later, in arrival order.

        Every arrival time is known before training (an upload's size is the layout's),
        so clients train in batches of ``deltas_in_flight_bytes``, each when its first
        update is due on the virtual clock, and the engine folds a batch's updates before
        the next one trains: a round holds a bounded number of deltas however many
        clients it has. Training takes no simulated time, so the outcome is the same as
        training every client at dispatch."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        job = self._job(task)
        config = job.config
        epochs = config.train.local_epochs
        open_round = _Round(task, set(device_ids))
        trainer = self.trainers[task.order.task]
        pop = self.population
        planned: list[_Planned] = []
        for device_id in device_ids:
            device = self.fleet.devices[device_id]
            samples = trainer.shards.num_train(config.data, device.index)
            down = self._download_bytes(device_id, task)
            jitter = 1.0
            if self._slow.round_sigma > 0:
                jitter = math.exp(self._slow.round_sigma * self._noise_rng.standard_normal())
            guess, _ = self._seconds(device, samples, epochs, down, down, now, jitter)
            drop_at = math.inf
            if self._rng.random() < pop.dropout:
                drop_at = now + self._rng.random() * guess
            drop_at = min(drop_at, self.fleet.online_until(device_id))
            if drop_at < now + guess:
                self.dropouts[(task.order.job_id, task.order.round)] += 1
                loop.call_at(
                    drop_at + pop.dropout_detect_s, self._fail, open_round, device_id, "dropped out"
                )
                continue
            up = job.pipeline.payload_bytes
            seconds, _ = self._seconds(device, samples, epochs, down, up, now, jitter)
            planned.append(_Planned(now + seconds, device_id, device, down, jitter))
        if planned:
            planned.sort(key=lambda p: p.arrival)  # stable: ties keep the selection's order
            model = self._global(task, config)
            members = self._foldable(task, job, trainer, planned)
            if members:
                loop.call_at(
                    members[0].arrival, self._train_folded, open_round, model, members, now
                )
                planned = planned[len(members) :]
            delta_bytes = max(1, sum(s.nbytes for s in task.layout))
            size = max(1, self.deltas_in_flight_bytes // delta_bytes)
            for start in range(0, len(planned), size):
                batch = planned[start : start + size]
                loop.call_at(batch[0].arrival, self._train, open_round, model, batch, now)
        return _Stream(self, open_round)

    def _foldable(
        self, task: TrainTask, job: _JobContext, trainer: ClientTrainer, planned: list[_Planned]
    ) -> list[_Planned]:
        """The first arrivals, which the round will take, when they can be folded where
        they train (``simulation.folding``): as many as it wants, each before its deadline.
        The later ones train and arrive one by one, as the round may take them in place of
        an update the strategy refused."""
        fold = task.fold
        if fold is None or not job.pipeline.stateless or not isinstance(trainer, FoldingTrainer):
            return []
        deadline = task.order.deadline
        return [p for p in planned[: fold.want] if p.arrival <= deadline]

    def _train(
        self, open_round: _Round, model: ModelState, batch: list[_Planned], dispatched: float
    ) -> None:
        """Train ``batch`` and schedule each update's arrival; a batch the round no longer
        wants is only let go, at the same times, when no client state depends on it."""
        loop = asyncio.get_running_loop()
        task = open_round.task
        job = self._job(task)
        if open_round.closed and job.pipeline.stateless:
            for p in batch:
                loop.call_at(p.arrival, self._let_go, open_round, p.device_id)
            return
        config = job.config
        epochs = config.train.local_epochs
        trainer = self.trainers[task.order.task]
        indices = [p.device.index for p in batch]
        try:
            results = trainer.train(model, indices, config.train, config.data, task.order.seed)
        except Exception as exc:  # a callback's exception would only be logged: hand it on
            open_round.error = exc
            open_round.results.put_nowait(Failed(batch[0].device_id, "training failed"))
            return
        for p, result in zip(batch, results, strict=True):
            delta, up = job.pipeline(p.device.index, result.delta, task.order.round)
            seconds, compute = self._seconds(
                p.device, result.num_samples, epochs, p.down, up, dispatched, p.jitter
            )
            metrics = {
                **result.metrics,
                "bytes_up": float(up),
                "bytes_down": float(p.down),
                COMPUTE_METRIC: compute,
            }
            update = Update(
                task.order.job_id, task.order.round, p.device_id, result.num_samples, delta, metrics
            )
            at = max(dispatched + seconds, loop.time())  # = p.arrival: sizes were known
            loop.call_at(at, self._arrive, open_round, update, seconds)
        del results

    def _train_folded(
        self, open_round: _Round, model: ModelState, members: list[_Planned], dispatched: float
    ) -> None:
        """Train and fold ``members`` where they train; each device is done at its own
        arrival, and their sum is handed over at the last one's (a refused update comes
        as a failure at its arrival, and the round may take a later device instead)."""
        loop = asyncio.get_running_loop()
        task = open_round.task
        fold = task.fold
        job = self._job(task)
        trainer = self.trainers[task.order.task]
        assert fold is not None and isinstance(trainer, FoldingTrainer)  # by _foldable
        request = FoldRequest(
            task.order.job_id,
            task.order.round,
            task.order.config_json,
            task.layout,
            job.uplink_seed,
            fold.strategy,
            fold.params_json,
        )
        indices = [p.device.index for p in members]
        try:
            folded = trainer.train_folded(model, indices, task.order.seed, request)
        except Exception as exc:  # a callback's exception would only be logged: hand it on
            open_round.error = exc
            open_round.results.put_nowait(Failed(members[0].device_id, "training failed"))
            return
        epochs = job.config.train.local_epochs
        taken: list[Arrival] = []
        last = dispatched
        for p, client in zip(members, folded.clients, strict=True):
            seconds, compute = self._seconds(
                p.device, client.num_samples, epochs, p.down, client.bytes_up, dispatched, p.jitter
            )
            at = max(dispatched + seconds, loop.time())  # = p.arrival: sizes were known
            if client.refused:
                loop.call_at(at, self._refuse, open_round, p.device_id, client.refused)
                continue
            metrics = {
                **client.metrics,
                "bytes_up": float(client.bytes_up),
                "bytes_down": float(p.down),
                COMPUTE_METRIC: compute,
            }
            taken.append(Arrival(p.device_id, client.num_samples, metrics, seconds))
            loop.call_at(at, self.events.freed, p.device_id, task.order.job_id)
            last = max(last, at)
        if folded.partial is not None and taken:
            result = Folded(task.order.round, folded.partial, tuple(taken))
            loop.call_at(last, self._arrive_folded, open_round, result)

    def _arrive_folded(self, open_round: _Round, result: Folded) -> None:
        """The last of a folded sum's devices arrived (each was freed at its own arrival)."""
        for member in result.members:
            open_round.pending.discard(member.device_id)
        if not open_round.closed:
            open_round.results.put_nowait(result)

    def _seconds(
        self,
        device: VirtualDevice,
        samples: int,
        epochs: int,
        down: int,
        up: int,
        now: float,
        jitter: float,
    ) -> tuple[float, float]:
        """The round's time on ``device`` and its compute part; with the population's
        slowdowns (profile noise, throttling, round noise) when any is on."""
        spp = self.population.seconds_per_sample
        total = device.round_seconds(samples, epochs, spp, down, up)
        compute = device.compute_seconds(samples, epochs, spp)
        if self._slow_active:  # off: exactly the noiseless times, bit for bit
            extra = compute * (self._slow.compute_factor(device.index, now) - 1.0)
            total, compute = (total + extra) * jitter, (compute + extra) * jitter
        return total, compute

    def _job(self, task: TrainTask) -> _JobContext:
        job = self._jobs.get(task.order.job_id)
        if job is None:
            config = RoundConfig.from_json(task.order.config_json)
            seed = self._seed * 7919 + len(self._jobs)
            state_dir = self.state_dir / task.order.job_id
            pipeline = SimulatedUplink(
                config, task.layout, seed, state_dir, self.population.clients
            )
            job = _JobContext(config, pipeline, seed)
            self._jobs[task.order.job_id] = job
        return job

    def _global(self, task: TrainTask, config: RoundConfig) -> ModelState:
        """The model devices train from: the broadcast as they decode it."""
        if self._model is None or self._model[0] != task.order.model_sha256:
            state = decode_model(self.blobs.get(task.order.model_sha256), config)
            self._model = (task.order.model_sha256, state)
        return self._model[1]

    def _download_bytes(self, device_id: str, task: TrainTask) -> int:
        held = self._held.get(device_id)
        self._held[device_id] = task.order.model_sha256
        if task.order.delta_sha256 and held == task.order.delta_base_sha256:
            return task.order.delta_size
        return task.order.model_size

    def _arrive(self, open_round: _Round, update: Update, seconds: float) -> None:
        device_id, job_id = update.device_id, open_round.task.order.job_id
        if open_round.closed:  # stale: it is free to serve again
            self._let_go(open_round, device_id)
            return
        open_round.pending.discard(device_id)

        def settle(reason: str | None) -> None:
            # Accepted or refused, the device is done with this round.
            self.events.freed(device_id, job_id)

        open_round.results.put_nowait(Delivered(update, seconds, settle))

    def _let_go(self, open_round: _Round, device_id: str) -> None:
        """A device whose update would have come too late is done: free it."""
        open_round.pending.discard(device_id)
        self.events.freed(device_id, open_round.task.order.job_id)

    def _refuse(self, open_round: _Round, device_id: str, why: str) -> None:
        """A folded device whose update its strategy refused arrives: as the server would
        have refused it."""
        open_round.pending.discard(device_id)
        self.events.freed(device_id, open_round.task.order.job_id)
        if not open_round.closed:
            open_round.results.put_nowait(Failed(device_id, f"refused: {why}"))

    def _fail(self, open_round: _Round, device_id: str, reason: str) -> None:
        open_round.pending.discard(device_id)
        self._held.pop(device_id, None)
        self.events.freed(device_id, open_round.task.order.job_id)
        if not open_round.closed:
            open_round.results.put_nowait(Failed(device_id, reason))
