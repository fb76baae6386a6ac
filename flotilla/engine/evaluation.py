"""Server-side use of a job's task: the round-0 model and held-out evaluation.

Both need the task importable on the server. Without it a job cannot be initialised
here, and rounds fall back to the metrics agents report.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np

from flotilla.core.errors import TaskLoadError
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import encode_state
from flotilla.engine.ports import Evaluator

log = logging.getLogger(__name__)


def initial_model(spec: JobSpec) -> bytes:
    """The round-0 checkpoint: the task's model initialised from the job's seed."""
    from flotilla.tasks import load_task, model_state

    task = load_task(spec.job.task)
    return encode_state(model_state(task.build_model(spec.job.seed)))


def server_evaluator(spec: JobSpec) -> Evaluator | None:
    try:
        from flotilla.tasks import load_model_state, load_task

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
