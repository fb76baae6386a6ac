"""Local training on a device: model in, compressed update out.

The task trains; this module turns its result into what travels: the delta from the global
model, optionally smoothed over rounds (update momentum), then encoded with the job's
uplink codec, with error feedback when the job asks for it. Per-job state (residuals,
momentum) lives in the agent's state dir, so it survives a restart of the agent.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flotilla.compression import (
    CodecContext,
    ErrorFeedback,
    decode_state_with,
    encode_state_with,
    make_codec,
)
from flotilla.core.allreduce import GroupPlan
from flotilla.core.blobs import sha256_hex
from flotilla.core.errors import TaskLoadError, WireError
from flotilla.core.spec import CompressionSection, DataSection, TrainSection, build_dataclass
from flotilla.core.tensors import ModelState, TensorSpec, decode_state, encode_state, state_spec
from flotilla.core.update import COMPUTE_METRIC
from flotilla.proto import flotilla_pb2 as pb


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


@dataclass(frozen=True, slots=True)
class RoundConfig:
    """What the server sends with a task, parsed and checked."""

    train: TrainSection
    data: DataSection
    compression: CompressionSection
    #: The model's layout; sent when the broadcast is a codec payload, which needs it.
    layout: tuple[TensorSpec, ...] | None = None
    #: Server-less rounds: how this round's devices all-reduce their updates.
    p2p: GroupPlan | None = None

    @classmethod
    def from_json(cls, text: str) -> RoundConfig:
        where = "task config"
        try:
            raw = json.loads(text)
            layout = raw.get("layout")
            specs = None
            if layout is not None:
                specs = tuple(
                    TensorSpec(str(n), str(d), tuple(int(x) for x in s)) for n, d, s in layout
                )
        except (ValueError, TypeError, AttributeError) as exc:
            raise WireError(f"{where} is malformed: {exc}") from exc
        p2p = raw.get("p2p")
        return cls(
            build_dataclass(TrainSection, raw.get("train", {}), where, "train."),
            build_dataclass(DataSection, raw.get("data", {}), where, "data."),
            build_dataclass(CompressionSection, raw.get("compression", {}), where, "compression."),
            specs,
            None if p2p is None else GroupPlan.from_dict(p2p),
        )


@dataclass(slots=True)
class LocalTrainer:
    """Runs a task on this device's shard. Called in a worker thread, one round at a time."""

    task_name: str
    shard: Any  # flotilla.tasks.Shard; typed loosely so this module stays torch-free
    #: Local files for tasks that read them (``--data``); such a task has ``load_path``.
    data_path: Path | None = None
    #: Where per-job residuals and update momentum are kept; None keeps them in memory.
    state_dir: Path | None = None
    _task: Any = field(default=None, init=False)
    _data: dict[str, Any] = field(default_factory=dict, init=False)
    _feedback: dict[str, ErrorFeedback] = field(default_factory=dict, init=False)
    _momentum: dict[str, ErrorFeedback] = field(default_factory=dict, init=False)

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

    def train(self, model_bytes: bytes | memoryview, work: pb.TrainTask) -> TrainOutcome:
        from flotilla.tasks import load_model_state, model_state

        task = self._load()
        config = RoundConfig.from_json(work.config_json)
        key = config.data.key()
        if key not in self._data:
            self._data = {key: self._load_data(task, config.data)}
        data = self._data[key]
        global_state = decode_model(model_bytes, config)
        model = task.build_model(0)
        load_model_state(model, global_state)
        started = time.perf_counter()
        num_samples, metrics = task.train(model, data, config.train, int(work.seed))
        # Reported so the server's scheduler can tell compute from transfer time.
        metrics = {**metrics, COMPUTE_METRIC: time.perf_counter() - started}
        metrics = {**metrics, **task.evaluate(model, data.val)}
        local = model_state(model)
        delta = {name: local[name] - global_state[name] for name in global_state}
        del local, model
        delta = self._smooth(work.job_id, delta, config.train.update_momentum)
        if config.p2p is not None:  # averaged with the group, compressed on hivemind's wire
            metrics = {k: float(v) for k, v in metrics.items()}
            return TrainOutcome(int(num_samples), metrics, b"", delta=delta)
        payload = self._encode(work, delta, config.compression)
        return TrainOutcome(
            int(num_samples),
            {k: float(v) for k, v in metrics.items()},
            payload,
            codec=config.compression.uplink,
        )

    def _smooth(self, job_id: str, delta: ModelState, beta: float) -> ModelState:
        """Update momentum: m = beta*m + (1-beta)*delta, kept per job across rounds."""
        if beta <= 0:
            return delta
        store = self._job_state(self._momentum, f"momentum:{job_id}", delta)
        out: ModelState = {}
        for name, value in delta.items():
            previous = store.residual(name, value.shape)
            m = (1.0 - beta) * value if previous is None else beta * previous + (1 - beta) * value
            out[name] = np.asarray(m, dtype=np.float32)
        store.load_state_dict(out)
        store.save()
        return out

    def _encode(self, work: pb.TrainTask, delta: ModelState, spec: CompressionSection) -> bytes:
        codec = make_codec(spec.uplink, spec.uplink_params)
        if codec.name == "none":
            return encode_state(delta)  # plain safetensors: what every client can send
        feedback = None
        if spec.error_feedback:
            feedback = self._job_state(self._feedback, work.job_id, delta)
        # Fresh entropy: stochastic codecs must round independently on every device.
        return encode_state_with(codec, delta, CodecContext(), feedback)

    def _job_state(
        self, cache: dict[str, ErrorFeedback], key: str, like: ModelState
    ) -> ErrorFeedback:
        if key not in cache:
            layout = state_spec(like)
            if self.state_dir is None:
                cache[key] = ErrorFeedback(key)
            else:
                cache[key] = ErrorFeedback.load(key, self.state_dir, layout)
        return cache[key]


def decode_model(payload: bytes | memoryview, config: RoundConfig) -> ModelState:
    """The broadcast model: plain safetensors, or the job's downlink codec payload."""
    spec = config.compression
    if spec.downlink == "none" or spec.downlink_delta:  # delta broadcasts rebuild whole models
        return decode_state(payload)
    if config.layout is None:
        raise WireError("a compressed broadcast came without the model's layout")
    codec = make_codec(spec.downlink, spec.downlink_params)
    return decode_state_with(payload, config.layout, len(payload), codec=codec)
