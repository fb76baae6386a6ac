"""Per-client state of a whole population in one memory-mapped file.

Error-feedback residuals and update momentum are a model's worth of floats per client:
10,000 clients of a 50k-parameter model are 2 GB. They live in a sparse file, one row per
client, so only the rows of clients that trained are ever written and only the rows in
use are paged in; the process's memory does not grow with the population.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from flotilla.core.tensors import ModelState, TensorSpec


class ClientStateStore:
    """One float32 vector in ``layout`` per client, absent until first written: the
    simulator's :class:`~flotilla.compression.pipeline.StateStore` (keyed by client index)."""

    def __init__(self, path: Path, clients: int, layout: tuple[TensorSpec, ...]) -> None:
        self._slices: list[tuple[str, int, int, tuple[int, ...]]] = []
        start = 0
        for spec in layout:
            size = math.prod(spec.shape)
            self._slices.append((spec.name, start, start + size, tuple(spec.shape)))
            start += size
        path.parent.mkdir(parents=True, exist_ok=True)
        # mode w+ sizes the file without writing it: a sparse file on every common FS.
        self._rows = np.memmap(path, dtype=np.float32, mode="w+", shape=(clients, max(start, 1)))
        self._present = np.zeros(clients, dtype=bool)

    def get(self, client: int) -> ModelState | None:
        """Views of the client's row (valid until the next ``put`` for it), or None."""
        if not self._present[client]:
            return None
        row = self._rows[client]
        return {name: row[a:b].reshape(shape) for name, a, b, shape in self._slices}

    def put(self, client: int, state: ModelState) -> None:
        row = self._rows[client]
        for name, a, b, _ in self._slices:
            row[a:b] = np.asarray(state[name], dtype=np.float32).reshape(-1)
        self._present[client] = True

    def __len__(self) -> int:
        return int(self._present.sum())
