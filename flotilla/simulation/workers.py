"""Training spread over several devices: one worker process per device.

Each worker owns a task, its clients' data and a trainer on its device (``cuda:1``, or
``cpu``); a round's clients are cut into contiguous slices, one per worker, and the
results come back in the clients' order: each client's delta, or, where the job's
strategy allows, one partial sum per worker (``simulation.folding``). Messages travel
over local pipes between this process and workers it started itself, never over a
network.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from flotilla.core.errors import FlotillaError
from flotilla.core.spec import DataSection, TrainSection
from flotilla.core.tensors import ModelState
from flotilla.core.timeouts import Timeouts
from flotilla.simulation.folding import FoldedSlice, FoldRequest, SliceFolder, merge_slices
from flotilla.simulation.training import ClientResult, ShardCache, make_trainer


def _serve(conn: Connection, task_name: str, count: int, device: str, batched: bool | None,
           threads: int) -> None:  # fmt: skip
    import torch

    from flotilla.tasks import load_task

    torch.set_num_threads(threads)
    task = load_task(task_name)
    trainer = make_trainer(task, ShardCache(task, count), device, batched)
    folder = SliceFolder(trainer)
    conn.send(("ready", type(trainer).__name__))
    while True:
        request = conn.recv()
        if request is None:
            return
        kind, args = request
        try:
            if kind == "fold":
                conn.send(("ok", folder.fold(*args)))
            else:
                conn.send(("ok", trainer.train(*args)))
        except Exception as exc:  # reported to the parent, which raises it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class WorkerPoolTrainer:
    """A :class:`ClientTrainer` whose clients train in worker processes, one per device."""

    def __init__(
        self,
        task_name: str,
        shards: ShardCache,
        devices: Sequence[str],
        batched: bool | None = None,
        timeouts: Timeouts | None = None,
    ) -> None:
        """``timeouts`` bound a worker's start (import torch, build the task), its share of
        a round, and its exit."""
        if not devices:
            raise FlotillaError("a worker pool needs at least one device")
        self.shards = shards
        #: Clients trained so far, and how many of them were folded where they trained.
        self.trained_clients = 0
        self.folded_clients = 0
        self._timeouts = timeouts or Timeouts()
        ctx = mp.get_context("spawn")
        cpu_workers = sum(1 for d in devices if not d.startswith("cuda"))
        threads = max(1, (mp.cpu_count() or 1) // max(cpu_workers, 1))
        self._workers: list[tuple[Any, Connection]] = []
        try:
            for device in devices:
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_serve,
                    args=(child, task_name, shards.count, device, batched, threads),
                    daemon=True,
                )
                proc.start()
                child.close()
                self._workers.append((proc, parent))
            start_s = self._timeouts.worker_start_s
            self.kind = {self._expect(conn, start_s)[1] for _, conn in self._workers}
        except BaseException:
            self.close()
            raise

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
        self,
        global_state: ModelState,
        clients: Sequence[int],
        seed: int,
        request: FoldRequest,
    ) -> FoldedSlice:
        """Train and fold ``clients`` where they train (``simulation.folding``): each
        worker folds its slice; the slices' sums are merged here."""
        folded = merge_slices(self._spread("fold", global_state, clients, seed, request))
        self.folded_clients += len(clients)
        return folded

    def _spread(
        self, kind: str, global_state: ModelState, clients: Sequence[int], *extra: Any
    ) -> list[Any]:
        """Each worker's answer to ``kind(model, slice, *extra)`` for its contiguous slice
        of ``clients``, in order."""
        self.trained_clients += len(clients)
        slices = split_evenly(list(clients), len(self._workers))
        busy = []
        for (_, conn), part in zip(self._workers, slices, strict=True):
            if part:
                conn.send((kind, (global_state, part, *extra)))
                busy.append(conn)
        return [self._expect(conn, self._timeouts.worker_round_s)[1] for conn in busy]

    @staticmethod
    def _expect(conn: Connection, timeout_s: float) -> tuple[str, Any]:
        if not conn.poll(timeout_s):
            raise FlotillaError(f"a training worker did not answer within {timeout_s:.0f}s")
        try:
            status, payload = conn.recv()
        except EOFError:
            raise FlotillaError("a training worker died") from None
        if status == "error":
            raise FlotillaError(f"a training worker failed: {payload}")
        return status, payload

    def close(self) -> None:
        for proc, conn in self._workers:
            with contextlib.suppress(OSError, BrokenPipeError):
                conn.send(None)
            conn.close()
            proc.join(timeout=self._timeouts.worker_stop_s)
            if proc.is_alive():
                proc.kill()
        self._workers.clear()


def split_evenly(items: list[int], parts: int) -> list[list[int]]:
    """``parts`` contiguous slices whose sizes differ by at most one."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out
