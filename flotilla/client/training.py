"""Local training on a device: model in, compressed update out.

The task trains; this module turns its result into what travels: the delta from the global
model, optionally smoothed over rounds (update momentum), then encoded with the job's
uplink codec, with error feedback when the job asks for it. Per-job state (residuals,
momentum) lives in the agent's state dir, so it survives a restart of the agent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flotilla.compression import CodecContext, make_codec
from flotilla.compression.broadcast import decode_model
from flotilla.compression.pipeline import FileStates, MemoryStates, StateStore, UpdatePipeline
from flotilla.core.blobs import sha256_hex
from flotilla.core.errors import TaskLoadError
from flotilla.core.round_config import RoundConfig
from flotilla.core.spec import DataSection
from flotilla.core.tensors import ModelState
from flotilla.core.update import COMPUTE_METRIC


@dataclass(frozen=True, slots=True)
class TrainWork:
    """What a device needs to train one round: the agent builds it from the server's task."""

    job_id: str
    seed: int
    config: RoundConfig


@dataclass(frozen=True, slots=True)
class TrainOutcome:
    num_samples: int
    metrics: dict[str, float]
    #: The encoded update: the uplink codec's safetensors payload.
    payload: bytes
    #: SHA-256 of ``payload``, computed where the payload is made (a worker thread), so the
    #: agent's event loop never hashes a model-sized buffer.
    payload_sha256: str = ""
    #: Name of the codec that encoded ``payload``.
    codec: str = "none"
    #: Server-less rounds: the update itself, for the all-reduce (``payload`` is empty).
    delta: ModelState | None = None

    def __post_init__(self) -> None:
        if not self.payload_sha256:
            object.__setattr__(self, "payload_sha256", sha256_hex(self.payload))


@dataclass(slots=True)
class LocalTrainer:
    """Runs a task on this device's shard. Called in a worker thread, one round at a time."""

    task_name: str
    shard: Any  # flotilla.tasks.Shard; typed loosely so this module stays torch-free
    #: Local files for tasks that read them (``--data``); such a task has ``load_path``.
    data_path: Path | None = None
    #: Where per-job residuals and update momentum are kept; None keeps them in memory.
    state_dir: Path | None = None
    #: The uplink codec's randomness; fresh OS entropy unless a test replays an encoding.
    entropy: Callable[[], CodecContext] = CodecContext
    _task: Any = field(default=None, init=False)
    _data: dict[str, Any] = field(default_factory=dict, init=False)
    _residuals: StateStore[str] = field(init=False)
    _velocity: StateStore[str] = field(init=False)

    def __post_init__(self) -> None:
        # Per job (keyed by job id), across rounds; files survive an agent restart.
        if self.state_dir is None:
            self._residuals, self._velocity = MemoryStates[str](), MemoryStates[str]()
        else:
            self._residuals = FileStates(self.state_dir)
            self._velocity = FileStates(self.state_dir, prefix="momentum:")

    def _load(self) -> Any:
        if self._task is None:
            from flotilla.tasks import load_task

            self._task = load_task(self.task_name)
        return self._task

    def _load_data(self, task: Any, data_cfg: DataSection) -> Any:
        if self.data_path is None:
            return task.load_shard(self.shard, data_cfg)
        if not hasattr(task, "load_path"):
            raise TaskLoadError(f"task {self.task_name} does not read local files (--data)")
        return task.load_path(self.data_path, data_cfg)

    def pipeline(self, config: RoundConfig) -> UpdatePipeline[str]:
        """The job's update pipeline over this device's stored momentum and residuals."""
        spec = config.compression
        return UpdatePipeline(
            make_codec(spec.uplink, spec.uplink_params),
            config.train.update_momentum,
            residuals=self._residuals if spec.error_feedback else None,
            velocity=self._velocity,
            entropy=self.entropy,
        )

    def train(self, model_bytes: bytes | memoryview, work: TrainWork) -> TrainOutcome:
        from flotilla.tasks import load_model_state, model_state

        task = self._load()
        config = work.config
        key = config.data.key()
        if key not in self._data:
            self._data = {key: self._load_data(task, config.data)}
        data = self._data[key]
        global_state = decode_model(model_bytes, config)
        model = task.build_model(0)
        load_model_state(model, global_state)
        started = time.perf_counter()
        num_samples, metrics = task.train(model, data, config.train, work.seed)
        # Reported so the server's scheduler can tell compute from transfer time.
        metrics = {**metrics, COMPUTE_METRIC: time.perf_counter() - started}
        metrics = {**metrics, **task.evaluate(model, data.val)}
        metrics = {k: float(v) for k, v in metrics.items()}
        local = model_state(model)
        delta: ModelState = {name: local[name] - global_state[name] for name in global_state}
        del local, model
        pipeline = self.pipeline(config)
        delta = pipeline.smooth(work.job_id, delta)
        if config.p2p is not None:  # averaged with the group, compressed on hivemind's wire
            return TrainOutcome(int(num_samples), metrics, b"", delta=delta)
        payload = pipeline.encode(work.job_id, delta)
        return TrainOutcome(int(num_samples), metrics, payload, codec=config.compression.uplink)
