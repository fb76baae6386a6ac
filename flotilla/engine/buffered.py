"""Asynchronous buffered rounds (FedBuff): devices train without waiting for each other.

Up to ``job.clients_per_round`` devices train at once, each on the newest model when it
was dispatched. Every update is folded as it arrives, down-weighted by how many models
were committed since its device started (its staleness); each ``buffer_size`` arrivals
commit a new model as the job's next round. A device that finishes is topped up with
fresh work at once, so no round waits for a straggler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from flotilla.core.errors import UpdateRejected
from flotilla.core.tensors import decode_state
from flotilla.engine.backend import Delivered, RoundResult
from flotilla.engine.rounds import JobRunner, RoundTally, next_result

log = logging.getLogger(__name__)

Arrival = tuple[int, RoundResult]


async def _drain(
    results: AsyncIterator[RoundResult],
    version: int,
    expected: int,
    deadline: float,
    runner: JobRunner,
    out: asyncio.Queue[Arrival],
) -> None:
    """Forward one dispatch's results, tagged with the model version they trained on."""
    async with contextlib.aclosing(results):  # type: ignore[type-var]
        for _ in range(expected):
            result = await next_result(results, deadline - runner.clock())
            if result is None:
                return
            await out.put((version, result))


async def run_buffered(runner: JobRunner) -> None:
    aggregator = runner._aggregator
    model = decode_state(
        await asyncio.to_thread(runner.blobs.get_mapped, runner.job.checkpoint_sha256)
    )
    aggregator.begin(runner.job.rounds_committed, model)
    del model
    arrivals: asyncio.Queue[Arrival] = asyncio.Queue()
    readers: set[asyncio.Task[None]] = set()
    training: set[str] = set()
    tally = RoundTally()
    started = runner.clock()
    try:
        while runner.job.rounds_committed < runner.job.rounds_total:
            _top_up(runner, training, readers, arrivals)
            try:
                version, result = await asyncio.wait_for(
                    arrivals.get(), timeout=runner.config.idle_poll_s
                )
            except asyncio.TimeoutError:
                continue
            if isinstance(result, Delivered):
                device_id = result.update.device_id
            else:
                device_id = result.device_id
            training.discard(device_id)
            runner.pool.release(device_id, runner.job.id)
            staleness = runner.job.rounds_committed - version
            one = RoundTally()  # this arrival alone, for the scheduler
            if runner.fold(result, one, staleness=staleness):
                tally.accepted += one.accepted
                tally.durations.update(one.durations)
            else:
                tally.failures += one.failures
            outcome = one.outcome(runner.job.id, version + 1, (device_id,))
            runner.pool.record(outcome)
            runner.selector.observe(outcome)
            del result
            if not aggregator.ready():  # type: ignore[attr-defined]
                continue
            try:
                await runner.commit(runner.job.rounds_committed + 1, started, tally)
            except UpdateRejected as exc:
                # FedBuff dropped the buffer and kept the current model: carry on, up to
                # the engine's limit of refusals in a row.
                runner.refused(runner.job.rounds_committed + 1, exc)
            tally = RoundTally()
            started = runner.clock()
    finally:
        for reader in readers:
            reader.cancel()
        for reader in list(readers):
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        for device_id in training:
            runner.pool.release(device_id, runner.job.id)


def _top_up(
    runner: JobRunner,
    training: set[str],
    readers: set[asyncio.Task[None]],
    arrivals: asyncio.Queue[Arrival],
) -> None:
    """Dispatch the newest model to idle devices until ``clients_per_round`` are training."""
    job = runner.spec.job
    free = job.clients_per_round - len(training)
    arbiter = runner.arbiter
    assert arbiter is not None
    idle = arbiter.idle(job.task) if free > 0 else []  # not those granted to other jobs
    if not idle:
        return
    chosen = runner.selector.select(runner.job.id, idle, free)
    if not chosen:
        return
    runner.pool.claim(chosen, runner.job.id)
    training.update(chosen)
    version = runner.job.rounds_committed
    task = runner._task(version + 1, runner.clock())
    results = runner.backend.dispatch(task, chosen)
    reader = asyncio.ensure_future(
        _drain(results, version, len(chosen), task.deadline, runner, arrivals)
    )
    readers.add(reader)

    def finished(done: asyncio.Task[None]) -> None:
        readers.discard(done)
        # Devices of this dispatch that never reported no longer count as training; the
        # gateway frees them when they poll again.
        training.difference_update(chosen)

    reader.add_done_callback(finished)
