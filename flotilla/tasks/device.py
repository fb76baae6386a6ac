"""A task on one device's data: a numpy model in, the trained numpy model out.

The agent's trainer (:mod:`flotilla.client.training`) gets one of these injected and never
imports a task or torch itself: what travels (deltas, codecs, momentum) is its business,
how a model learns is the task's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flotilla.core.errors import TaskLoadError
from flotilla.core.spec import DataSection, TrainSection
from flotilla.core.tensors import ModelState
from flotilla.core.update import COMPUTE_METRIC, LocalRound
from flotilla.tasks.base import LocalData, Shard, Task, load_model_state, load_task, model_state


@dataclass(slots=True)
class ShardTraining:
    """Trains the task ``task_name`` on this device's shard (or its ``--data`` files).

    The task loads on first use, in the caller's worker thread: importing torch and the data
    takes seconds the agent's event loop must not wait for.
    """

    task_name: str
    shard: Shard
    #: Local files for tasks that read them (``--data``); such a task has ``load_path``.
    data_path: Path | None = None
    #: The task itself, when the caller has one (an in-process fleet); else loaded by name.
    task: Task | None = None
    #: The shard's data for the last data section seen (jobs rarely differ in it).
    _data: dict[str, LocalData] = field(default_factory=dict, init=False)

    def __call__(
        self, global_state: ModelState, train: TrainSection, data: DataSection, seed: int
    ) -> LocalRound:
        task = self._load()
        local = self._local_data(task, data)
        model = task.build_model(0)
        load_model_state(model, global_state)
        started = time.perf_counter()
        num_samples, metrics = task.train(model, local, train, seed)
        # Reported so the server's scheduler can tell compute from transfer time.
        metrics = {**metrics, COMPUTE_METRIC: time.perf_counter() - started}
        if local.num_val:
            metrics = {**metrics, **task.evaluate(model, local.val)}
        numbers = {k: float(v) for k, v in metrics.items()}
        return LocalRound(int(num_samples), numbers, model_state(model), local.num_train)

    def _load(self) -> Task:
        if self.task is None:
            self.task = load_task(self.task_name)
        return self.task

    def _local_data(self, task: Task, data: DataSection) -> LocalData:
        key = data.key()
        if key not in self._data:
            self._data = {key: self._read(task, data)}
        return self._data[key]

    def _read(self, task: Task, data: DataSection) -> LocalData:
        if self.data_path is None:
            return task.load_shard(self.shard, data)
        reader: Any = getattr(task, "load_path", None)
        if reader is None:
            raise TaskLoadError(f"task {self.task_name} does not read local files (--data)")
        loaded: LocalData = reader(self.data_path, data)
        return loaded
