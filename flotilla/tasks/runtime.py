"""The server side of a job's task: its round-0 model and held-out evaluation.

Both need the task importable in this process. Without it a job cannot be initialised
here, and rounds fall back to the metrics agents report. The engine reaches this through
its ``TaskRuntime`` port (``flotilla.engine.ports``), injected by the server and the
simulator, so the engine never imports a task.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import numpy as np

from flotilla.core.errors import TaskLoadError
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import encode_state
from flotilla.tasks.base import load_model_state, load_task, model_state

log = logging.getLogger(__name__)

#: The engine's ``Evaluator``: a global model in, held-out metrics out.
Evaluate = Callable[[Mapping[str, np.ndarray]], dict[str, float]]


class LocalTasks:
    """Tasks imported into this process by entry point (``module:Class``)."""

    def initial_model(self, spec: JobSpec) -> bytes:
        """The round-0 checkpoint: the task's model initialised from the job's seed."""
        task = load_task(spec.job.task)
        return encode_state(model_state(task.build_model(spec.job.seed)))

    def evaluator(self, spec: JobSpec) -> Evaluate | None:
        try:
            task = load_task(spec.job.task)
        except (TaskLoadError, ImportError) as exc:
            log.info("no server-side evaluation for %s: %s", spec.job.task, exc)
            return None
        heldout = task.heldout()
        model = task.build_model(spec.job.seed)

        def evaluate(state: Mapping[str, np.ndarray]) -> dict[str, float]:
            load_model_state(model, state)
            return {k: float(v) for k, v in task.evaluate(model, heldout).items()}

        return evaluate
