"""Local training on the device: global model in, encoded delta out."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flotilla.core.errors import TaskLoadError
from flotilla.core.spec import DataSection, TrainSection, build_dataclass
from flotilla.core.tensors import decode_state, encode_state
from flotilla.proto import flotilla_pb2 as pb


@dataclass(frozen=True, slots=True)
class TrainOutcome:
    num_samples: int
    metrics: dict[str, float]
    #: safetensors bytes of local model minus global model.
    payload: bytes


@dataclass(slots=True)
class LocalTrainer:
    """Runs a task on this device's shard. Called in a worker thread, one round at a time."""

    task_name: str
    shard: Any  # flotilla.tasks.Shard; typed loosely so this module stays torch-free
    #: Local files for tasks that read them (``--data``); such a task has ``load_path``.
    data_path: Path | None = None
    _task: Any = field(default=None, init=False)
    _data: dict[DataSection, Any] = field(default_factory=dict, init=False)

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

    def train(self, model_bytes: bytes, work: pb.TrainTask) -> TrainOutcome:
        from flotilla.tasks import load_model_state, model_state

        task = self._load()
        config = json.loads(work.config_json)
        train_cfg = build_dataclass(TrainSection, config.get("train", {}), "task config")
        data_cfg = build_dataclass(DataSection, config.get("data", {}), "task config")
        if data_cfg not in self._data:
            self._data = {data_cfg: self._load_data(task, data_cfg)}
        data = self._data[data_cfg]
        global_state = decode_state(model_bytes)
        model = task.build_model(0)
        load_model_state(model, global_state)
        num_samples, metrics = task.train(model, data, train_cfg, int(work.seed))
        metrics = {**metrics, **task.evaluate(model, data.val)}
        local = model_state(model)
        delta = {name: local[name] - global_state[name] for name in global_state}
        return TrainOutcome(
            int(num_samples), {k: float(v) for k, v in metrics.items()}, encode_state(delta)
        )
