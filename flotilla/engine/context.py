"""The public round context every round mode runs over, and the mode protocol.

:class:`~flotilla.engine.rounds.JobRunner` is the context: it owns the job's aggregator,
checkpoint and selector; a :class:`RoundMode` (synchronous, buffered, server-less) decides
only when to select, dispatch and commit. Modes import this module, never the runner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from flotilla.aggregation import Aggregator
from flotilla.core.errors import UpdateRejected
from flotilla.core.records import JobRecord
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import ModelState
from flotilla.engine.backend import ResultStream, RoundResult, TrainTask
from flotilla.engine.plan import JobPlan
from flotilla.engine.services import EngineConfig, P2PPeers
from flotilla.engine.tally import RoundTally
from flotilla.scheduling import Grant, Lease


@dataclass(frozen=True, slots=True)
class Dispatched:
    """A task offered to a lease's devices, and the stream of their results."""

    task: TrainTask
    results: ResultStream


class RoundContext(Protocol):
    """What a round mode may use of its job: nothing private, nothing else."""

    @property
    def job(self) -> JobRecord: ...

    @property
    def spec(self) -> JobSpec: ...

    @property
    def plan(self) -> JobPlan: ...

    @property
    def config(self) -> EngineConfig: ...

    @property
    def aggregator(self) -> Aggregator: ...

    @property
    def p2p(self) -> P2PPeers | None: ...

    def clock(self) -> float: ...

    async def global_model(self) -> ModelState:
        """The job's current checkpoint, memory-mapped."""
        ...

    async def select(self) -> tuple[Grant, float]:
        """Devices for a round from the arbiter, and the sampling rate (privacy)."""
        ...

    def grant_now(self, want: int) -> Grant | None:
        """Up to ``want`` idle devices at once, without waiting (buffered top-ups)."""
        ...

    def task(self, round_no: int, started: float, foldable: bool = False) -> TrainTask:
        """Round ``round_no``'s work; ``foldable``: the backend may hand its updates
        over folded (:class:`~flotilla.engine.backend.Folded`), where the strategy folds."""
        ...

    def dispatch(
        self, grant: Grant, make_task: Callable[[Sequence[str]], TrainTask]
    ) -> Lease[Dispatched] | None:
        """Claim the grant's devices and offer them ``make_task(devices)``, in one step."""
        ...

    def fold(self, result: RoundResult, tally: RoundTally, staleness: int | None = None) -> bool:
        """Hand one result to the aggregator and settle it; True when it was taken."""
        ...

    def observe(self, tally: RoundTally, round_no: int, selected: Sequence[str]) -> None:
        """Tell the scheduler how a round (or one buffered arrival) went, and the event
        stream which devices failed it and why."""
        ...

    async def commit(
        self,
        round_no: int,
        started: float,
        tally: RoundTally,
        rate: float | None = None,
        model: ModelState | None = None,
        expect_sha256: str = "",
    ) -> None: ...

    async def rollback(self) -> None:
        """Forget what an uncommitted round did to the aggregator's state."""
        ...

    def retried(self, round_no: int, reason: str) -> None:
        """A round attempt ends without a commit (``reason``: ``quorum``, ``no_devices``,
        ``no_agreement``, ``secagg``); it will be tried again."""
        ...

    def refused(self, round_no: int, exc: UpdateRejected) -> None:
        """Count a refused aggregate; too many in a row end the job (FlotillaError)."""
        ...


class RoundMode(Protocol):
    """How a job's rounds happen; runs until the job has all its rounds (or fails)."""

    async def run(self, ctx: RoundContext) -> None: ...
