"""Learning tasks: the seam between the platform and a model plus its data.

Module map:

- :mod:`flotilla.tasks.base` -- the :class:`Task` protocol (and :class:`ExportableTask`, the
  optional one a task implements to be exported for on-device training), :class:`Shard`,
  :class:`LocalData`, :func:`load_task` (entry points like
  ``"flotilla.tasks.digits:DigitsTask"``) and the torch <-> numpy model-state conversion.
- :mod:`flotilla.tasks.device` -- :class:`ShardTraining`, a task on one device's data (numpy
  model in, trained numpy model out), injected into the agent's trainer.
- :mod:`flotilla.tasks.digits` -- :class:`DigitsTask`, the offline reference task (MLP on
  scikit-learn's 8x8 digits, Dirichlet non-IID shards).
- :mod:`flotilla.tasks.synthetic` -- :class:`Linear100K` and :class:`Linear10M`, load-testing
  tasks (one linear layer on a few random examples) for benchmarks.

Importing this package does not import torch or scikit-learn, so torch-free processes (the
server, light devices) can use the helpers; the tasks are imported on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flotilla.tasks.base import (
    Examples,
    ExportableTask,
    LocalData,
    Shard,
    Task,
    importable_from,
    load_model_state,
    load_task,
    model_state,
    proximal_anchor,
    proximal_term,
)
from flotilla.tasks.device import ShardTraining

if TYPE_CHECKING:
    from flotilla.tasks.digits import DigitsTask
    from flotilla.tasks.synthetic import Linear10M, Linear100K

__all__ = [
    "DigitsTask",
    "Examples",
    "ExportableTask",
    "Linear10M",
    "Linear100K",
    "LocalData",
    "Shard",
    "ShardTraining",
    "Task",
    "importable_from",
    "load_model_state",
    "load_task",
    "model_state",
    "proximal_anchor",
    "proximal_term",
]


def __getattr__(name: str) -> Any:
    """Import a task (and so torch) only when someone asks for it."""
    if name == "DigitsTask":
        from flotilla.tasks.digits import DigitsTask

        return DigitsTask
    if name in ("Linear100K", "Linear10M"):
        from flotilla.tasks import synthetic

        return getattr(synthetic, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
