"""The Task seam: what an agent needs from a learning problem, and nothing more.

A task builds a model, yields a device's own data shard, trains and evaluates. Model states
cross every boundary as ordered ``name -> numpy array`` mappings (see
:mod:`flotilla.core.tensors`), so the server and light devices never need torch. This module
itself imports torch only for type checking, keeping ``import flotilla.tasks`` cheap.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeAlias, runtime_checkable

import numpy as np

from flotilla.core.errors import TaskLoadError
from flotilla.core.tensors import ModelState

if TYPE_CHECKING:
    import torch

    from flotilla.core.spec import DataSection, TrainSection

#: Inputs and integer labels, aligned on the first dimension.
Examples: TypeAlias = "tuple[torch.Tensor, torch.Tensor]"


@dataclass(frozen=True, slots=True)
class Shard:
    """Which slice of the partition a device owns: ``index`` of ``count`` disjoint shards."""

    index: int
    count: int

    def __post_init__(self) -> None:
        for name in ("index", "count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"shard {name} must be an integer, got {value!r}")
        if self.count < 1:
            raise ValueError(f"shard count must be >= 1, got {self.count}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard index must be in [0, {self.count}), got {self.index}")

    @classmethod
    def parse(cls, text: str) -> Shard:
        """Read ``"i/N"`` as given on a command line or in agent config."""
        index, sep, count = text.strip().partition("/")
        try:
            if not sep:
                raise ValueError
            return cls(int(index), int(count))
        except ValueError as exc:
            detail = f": {exc}" if str(exc) else ""
            raise ValueError(
                f"shard must look like 'i/N' with 0 <= i < N, got {text!r}{detail}"
            ) from None

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass(frozen=True, slots=True)
class LocalData:
    """A device's own examples: ``train`` to fit on, ``val`` to report local metrics.

    ``val`` may be empty (no examples): the device then trains on everything it has and
    reports no validation scores of its own; a round's ``accuracy`` and ``loss`` then come
    from the server's held-out evaluation alone."""

    train: Examples
    val: Examples

    @property
    def num_train(self) -> int:
        return int(self.train[1].shape[0])

    @property
    def num_val(self) -> int:
        return int(self.val[1].shape[0])


@runtime_checkable
class Task(Protocol):
    """A learning problem as agents and the server see it; every method is deterministic."""

    def build_model(self, seed: int) -> torch.nn.Module:
        """A freshly initialised model; the same seed gives the same weights everywhere."""
        ...

    def load_shard(self, shard: Shard, data: DataSection) -> LocalData:
        """This device's data; shards of one (count, alpha, seed) are disjoint."""
        ...

    def heldout(self) -> Examples:
        """The server's evaluation split, identical for every caller."""
        ...

    def train(
        self, model: torch.nn.Module, data: LocalData, config: TrainSection, seed: int
    ) -> tuple[int, dict[str, float]]:
        """Train ``model`` in place; return the sample count (FedAvg weight) and metrics."""
        ...

    def evaluate(self, model: torch.nn.Module, data: Examples) -> dict[str, float]:
        """Metrics on ``data``, at least ``accuracy`` and ``loss``."""
        ...


@runtime_checkable
class ExportableTask(Task, Protocol):
    """A task whose local training step can leave Python (``flotilla job export --format
    executorch``): the model and its loss as one module, traced on an example batch."""

    def training_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """A module over ``model``'s own parameters whose ``forward(inputs, labels)`` returns
        the batch's mean training loss first (the loss ``train`` minimises), then anything."""
        ...

    def example_batch(self, batch_size: int) -> Examples:
        """Inputs and labels of one batch, shaped and typed as devices will feed them."""
        ...


@contextlib.contextmanager
def importable_from(dirs: Sequence[Path]) -> Iterator[None]:
    """Modules in ``dirs`` importable for the duration, ahead of installed packages, as
    ``python script.py`` puts the script's directory first; ``sys.path`` is restored after.
    Worker processes started meanwhile with ``spawn`` inherit it."""
    added = [str(d) for d in dirs if str(d) not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for entry in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(entry)


def load_task(entrypoint: str) -> Task:
    """Import ``package.module:Name`` and instantiate it, so job specs can name any task."""
    module_name, sep, attr = (
        entrypoint.partition(":") if isinstance(entrypoint, str) else ("", "", "")
    )
    if not sep or not module_name.strip() or not attr.strip() or ":" in attr:
        raise TaskLoadError(
            f"task entry point must look like 'package.module:Name', got {entrypoint!r}"
        )
    module_name, attr = module_name.strip(), attr.strip()
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a broken task module must not crash the agent opaquely
        raise TaskLoadError(
            f"task {entrypoint!r}: cannot import module {module_name!r}: {exc}"
        ) from exc
    try:
        factory = getattr(module, attr)
    except AttributeError:
        raise TaskLoadError(
            f"task {entrypoint!r}: module {module_name!r} has no attribute {attr!r}"
        ) from None
    if not callable(factory):
        raise TaskLoadError(f"task {entrypoint!r}: {attr!r} is not a class or factory")
    try:
        task = factory()
    except Exception as exc:
        raise TaskLoadError(f"task {entrypoint!r}: constructing {attr} failed: {exc}") from exc
    if not isinstance(task, Task):
        raise TaskLoadError(f"task {entrypoint!r}: {attr}() does not implement the Task protocol")
    return task


def model_state(model: torch.nn.Module) -> ModelState:
    """The model's tensors as float32 numpy copies, in ``state_dict`` order, for the wire."""
    return {
        name: np.array(tensor.detach().cpu().float().numpy(), dtype=np.float32, order="C")
        for name, tensor in model.state_dict().items()
    }


def load_model_state(model: torch.nn.Module, state: Mapping[str, np.ndarray]) -> None:
    """Copy ``state`` into ``model``; names and shapes must match exactly, so no silent drift."""
    import torch

    own = model.state_dict()
    missing = [name for name in own if name not in state]
    extra = [name for name in state if name not in own]
    if missing or extra:
        raise ValueError(f"model state names differ: missing {missing}, unexpected {extra}")
    for name, tensor in own.items():
        value = np.asarray(state[name])
        if tuple(value.shape) != tuple(tensor.shape):
            raise ValueError(
                f"tensor {name!r}: shape {list(value.shape)}, model expects {list(tensor.shape)}"
            )
    with torch.no_grad():
        for name, tensor in own.items():
            value = np.asarray(state[name])
            # Wire states are often read-only views, which torch will not wrap: copy those
            # (a model-sized temporary); wrap writable ones directly.
            if not value.flags.writeable or not value.flags.c_contiguous:
                value = np.array(value)
            tensor.copy_(torch.from_numpy(value))


def proximal_anchor(model: torch.nn.Module, mu: float) -> dict[str, torch.Tensor]:
    """FedProx: a frozen copy of the global weights the local ones are pulled toward.

    Empty when ``mu`` is 0, so tasks can call it unconditionally.
    """
    if mu <= 0:
        return {}
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def proximal_term(
    model: torch.nn.Module, anchor: Mapping[str, torch.Tensor], mu: float
) -> torch.Tensor:
    """``mu/2 * ||w - w_global||^2`` over the trainable parameters (Li et al., 2020)."""
    terms = [((p - anchor[n]) ** 2).sum() for n, p in model.named_parameters() if n in anchor]
    total: torch.Tensor = sum(terms[1:], terms[0])
    return 0.5 * mu * total
