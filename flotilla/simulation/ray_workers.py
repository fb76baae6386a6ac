"""Training workers as Ray actors, for users who outgrow one machine (``--backend ray``).

With ``RAY_ADDRESS`` set, the simulator joins that cluster. Otherwise it starts a private
single-node Ray whose every listener is on the loopback interface: Ray binds to the
machine's own address unless told ``127.0.0.1`` as its node address, and a simulation on
a laptop has no business opening ports to the network. One actor per ``--devices``
entry holds the task, its clients' data and a trainer, exactly like a local worker, and
folds its clients where they train the same way (``simulation.folding``): what crosses
the network per round is the model out and one partial sum back per actor.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flotilla.core.errors import FlotillaError
from flotilla.core.spec import DataSection, TrainSection
from flotilla.core.tensors import ModelState
from flotilla.core.timeouts import Timeouts
from flotilla.simulation.folding import FoldedSlice, FoldRequest, SliceFolder, merge_slices
from flotilla.simulation.training import ClientResult, ShardCache, make_trainer
from flotilla.simulation.workers import split_evenly

LOOPBACK = "127.0.0.1"
#: Ray's switch between "cluster node" (bind the machine's address) and a local-only node.
SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class _TrainerActor:
    def __init__(
        self, task_name: str, count: int, device: str, batched: bool | None, dirs: list[str]
    ) -> None:
        import sys

        from flotilla.tasks import load_task

        sys.path[:0] = [d for d in dirs if d not in sys.path]  # this actor's process only
        task = load_task(task_name)
        self._trainer = make_trainer(task, ShardCache(task, count), device, batched)
        self._folder = SliceFolder(self._trainer)

    def kind(self) -> str:
        return type(self._trainer).__name__

    def train(
        self,
        global_state: ModelState,
        clients: list[int],
        train: TrainSection,
        data: DataSection,
        seed: int,
    ) -> list[ClientResult]:
        return self._trainer.train(global_state, clients, train, data, seed)

    def fold(
        self, global_state: ModelState, clients: list[int], seed: int, request: FoldRequest
    ) -> FoldedSlice:
        return self._folder.fold(global_state, clients, seed, request)


def start_ray(num_cpus: int | None = None) -> bool:
    """Join ``RAY_ADDRESS``, or start a loopback-only local Ray; True when we started it."""
    # Ray resolves "127.0.0.1" to the machine's own address unless, when it is imported,
    # this says the node is not part of a cluster; its processes inherit the setting.
    saved = os.environ.get(SINGLE_NODE_ENV)
    os.environ[SINGLE_NODE_ENV] = "0"
    try:
        import ray

        if ray.is_initialized():
            return False
        common: dict[str, Any] = {
            "include_dashboard": False,
            "log_to_driver": False,
            "configure_logging": False,
        }
        if os.environ.get("RAY_ADDRESS"):
            ray.init(**common)
            return False
        ray.init(_node_ip_address=LOOPBACK, num_cpus=num_cpus, **common)
    finally:
        if saved is None:
            del os.environ[SINGLE_NODE_ENV]
        else:
            os.environ[SINGLE_NODE_ENV] = saved
    address = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    if address != LOOPBACK:
        ray.shutdown()
        raise FlotillaError(
            f"local Ray came up on {address}, not loopback: Ray was imported before "
            f"flotilla could configure it; set {SINGLE_NODE_ENV}=0 in the environment"
        )
    return True


class RayTrainer:
    """A :class:`ClientTrainer` whose clients train in Ray actors, one per device."""

    def __init__(
        self,
        task_name: str,
        shards: ShardCache,
        devices: Sequence[str],
        batched: bool | None = None,
        task_dirs: Sequence[Path] = (),
        timeouts: Timeouts | None = None,
    ) -> None:
        """``task_dirs``: searched first for the task's module in each actor's process."""
        if not devices:
            raise FlotillaError("Ray training needs at least one device")
        self.shards = shards
        self._timeouts = timeouts or Timeouts()
        self._started = start_ray()  # before any `import ray`: it settles the bind address
        import ray

        actor: Any = ray.remote(_TrainerActor)
        self._actors: list[Any] = []
        for device in devices:
            gpus = 1 if device.startswith("cuda") else 0
            self._actors.append(
                actor.options(num_cpus=1, num_gpus=gpus).remote(
                    task_name,
                    shards.count,
                    "cuda:0" if gpus else device,
                    batched,
                    [str(d) for d in task_dirs],
                )
            )
        try:
            kinds = [a.kind.remote() for a in self._actors]
            self.kind = set(ray.get(kinds, timeout=self._timeouts.worker_start_s))
        except Exception as exc:
            self.close()
            raise FlotillaError(f"Ray training actors did not start: {exc}") from exc

    def train(
        self,
        global_state: ModelState,
        clients: Sequence[int],
        train: TrainSection,
        data: DataSection,
        seed: int,
    ) -> list[ClientResult]:
        done = self._spread("train", global_state, clients, train, data, seed)
        return [r for results in done for r in results]

    def train_folded(
        self, global_state: ModelState, clients: Sequence[int], seed: int, request: FoldRequest
    ) -> FoldedSlice:
        """Each actor folds its slice (``simulation.folding``); the partials merge here."""
        return merge_slices(self._spread("fold", global_state, clients, seed, request))

    def _spread(
        self, method: str, global_state: ModelState, clients: Sequence[int], *extra: Any
    ) -> list[Any]:
        """Each actor's ``method(model, slice, *extra)`` for its contiguous slice of
        ``clients``, in order; the model goes into Ray's object store once."""
        import ray

        model = ray.put(global_state)
        calls = [
            getattr(actor, method).remote(model, part, *extra)
            for actor, part in zip(
                self._actors, split_evenly(list(clients), len(self._actors)), strict=True
            )
            if part
        ]
        return list(ray.get(calls, timeout=self._timeouts.worker_round_s))

    def close(self) -> None:
        import ray

        for actor in self._actors:
            ray.kill(actor)
        self._actors.clear()
        if self._started:
            ray.shutdown()
            self._started = False
