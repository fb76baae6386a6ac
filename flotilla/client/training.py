"""Local training on a device: model in, compressed update out.

The task trains; this module turns its result into what travels: the delta from the global
model, optionally smoothed over rounds (update momentum), then encoded with the job's
uplink codec, with error feedback when the job asks for it. Per-job state (residuals,
momentum) lives in the agent's state dir, so it survives a restart of the agent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from flotilla.compression import CodecContext, make_codec
from flotilla.compression.broadcast import decode_model
from flotilla.compression.pipeline import FileStates, MemoryStates, StateStore, UpdatePipeline
from flotilla.core.blobs import sha256_hex
from flotilla.core.round_config import RoundConfig
from flotilla.core.spec import DataSection, TrainSection
from flotilla.core.tensors import ModelState
from flotilla.core.update import LocalRound


@dataclass(frozen=True, slots=True)
class TrainWork:
    """What a device needs to train one round: the agent builds it from the server's task."""

    job_id: str
    seed: int
    config: RoundConfig
    #: The uplink codec the server chose for this device (``WorkOrder.uplink_codec``);
    #: ``""``: the job's ``compression.uplink``.
    uplink_codec: str = ""

    @property
    def codec(self) -> str:
        return self.uplink_codec or self.config.compression.uplink


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
    #: Training samples the task's data on this device holds (``LocalRound.samples_held``);
    #: None where the task cannot tell.
    samples_held: int | None = None

    def __post_init__(self) -> None:
        if not self.payload_sha256:
            object.__setattr__(self, "payload_sha256", sha256_hex(self.payload))


class RoundTraining(Protocol):
    """A task on this device's data (``flotilla.tasks.ShardTraining``): the client never
    imports a task or torch, so light devices and the simulator can share this module."""

    #: The task's entry point, as the device announces it (``package.module:Name``).
    @property
    def task_name(self) -> str: ...

    def __call__(
        self, global_state: ModelState, train: TrainSection, data: DataSection, seed: int
    ) -> LocalRound: ...


@dataclass(slots=True)
class LocalTrainer:
    """Trains one round and turns the result into what travels. Called in a worker thread,
    one round at a time."""

    training: RoundTraining
    #: Where per-job residuals and update momentum are kept; None keeps them in memory.
    state_dir: Path | None = None
    #: The uplink codec's randomness; fresh OS entropy unless a test replays an encoding.
    entropy: Callable[[], CodecContext] = CodecContext
    _residuals: StateStore[str] = field(init=False)
    _velocity: StateStore[str] = field(init=False)
    #: Job -> the codec its residual was kept for: what one codec dropped means nothing
    #: to another, so a change of codec starts error feedback afresh.
    _residual_codec: dict[str, str] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        # Per job (keyed by job id), across rounds; files survive an agent restart.
        if self.state_dir is None:
            self._residuals, self._velocity = MemoryStates[str](), MemoryStates[str]()
        else:
            self._residuals = FileStates(self.state_dir)
            self._velocity = FileStates(self.state_dir, prefix="momentum:")

    @property
    def task_name(self) -> str:
        """The task this device trains, as it announces it to the server."""
        return self.training.task_name

    def pipeline(self, config: RoundConfig, codec: str = "") -> UpdatePipeline[str]:
        """The job's update pipeline over this device's stored momentum and residuals,
        encoding with ``codec`` (``""``: the job's ``compression.uplink``)."""
        spec = config.compression
        name = codec or spec.uplink
        return UpdatePipeline(
            make_codec(name, spec.uplink_params_of(name)),
            config.train.update_momentum,
            residuals=self._residuals if spec.error_feedback else None,
            velocity=self._velocity,
            entropy=self.entropy,
        )

    def train(self, model_bytes: bytes | memoryview, work: TrainWork) -> TrainOutcome:
        config = work.config
        global_state = decode_model(model_bytes, config)
        trained = self.training(global_state, config.train, config.data, work.seed)
        metrics, local = trained.metrics, trained.state
        num_samples, held = trained.num_samples, trained.samples_held
        delta: ModelState = {name: local[name] - global_state[name] for name in global_state}
        del local, trained
        pipeline = self.pipeline(config, work.codec)
        delta = pipeline.smooth(work.job_id, delta)
        if config.p2p is not None or config.secagg is not None:
            # Averaged with the group on hivemind's wire, or masked (SecAgg+ quantizes it).
            return TrainOutcome(int(num_samples), metrics, b"", delta=delta, samples_held=held)
        if pipeline.residuals is not None:
            held_for = self._residual_codec.get(work.job_id, work.codec)
            if held_for != work.codec:
                pipeline.residuals.put(work.job_id, {})
            self._residual_codec[work.job_id] = work.codec
        payload = pipeline.encode(work.job_id, delta)
        return TrainOutcome(int(num_samples), metrics, payload, codec=work.codec, samples_held=held)
