"""What the engine needs from persistence, blobs, evaluation and tasks: small protocols."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Protocol

import numpy as np

from flotilla.core.records import JobRecord, RoundCommit
from flotilla.core.spec import JobSpec

#: Evaluates a global model on held-out data; None when the server cannot run the task.
Evaluator = Callable[[Mapping[str, np.ndarray]], dict[str, float]]


class Ledger(Protocol):
    """Durable record of jobs and their committed rounds."""

    async def commit_round(self, commit: RoundCommit) -> JobRecord: ...

    async def set_job_state(self, job_id: str, state: str) -> JobRecord: ...


class Blobs(Protocol):
    """Content-addressed storage of model checkpoints."""

    def put(self, data: bytes | bytearray | memoryview) -> str: ...

    def put_parts(self, parts: Iterable[bytes | bytearray | memoryview]) -> str: ...

    def get(self, sha256: str) -> bytes: ...

    def get_mapped(self, sha256: str) -> memoryview: ...

    def path(self, sha256: str) -> Path: ...


class TaskRuntime(Protocol):
    """The server side of a job's task, injected so the engine never imports a task."""

    def initial_model(self, spec: JobSpec) -> bytes:
        """The round-0 checkpoint, from the job's seed (TaskLoadError: no such task)."""
        ...

    def evaluator(self, spec: JobSpec) -> Evaluator | None:
        """Held-out evaluation of the job's models; None when this process cannot run it."""
        ...
