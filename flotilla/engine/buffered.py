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
from dataclasses import dataclass

from flotilla.aggregation import Buffering, StalenessWeighted
from flotilla.core.errors import FlotillaError, UpdateRejected
from flotilla.engine.backend import Delivered, RoundResult, senders
from flotilla.engine.context import Dispatched, RoundContext
from flotilla.engine.tally import RoundTally, next_result
from flotilla.scheduling import Lease

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Arrival:
    #: The model version its device trained on.
    version: int
    result: RoundResult
    lease: Lease[Dispatched]


async def _drain(
    lease: Lease[Dispatched], version: int, ctx: RoundContext, out: asyncio.Queue[_Arrival]
) -> None:
    """Forward one dispatch's results, tagged with the model version they trained on."""
    deadline = lease.work.task.order.deadline
    async with contextlib.aclosing(lease.work.results) as results:
        for _ in range(len(lease.devices)):
            result = await next_result(results, deadline - ctx.clock())
            if result is None:
                return
            await out.put(_Arrival(version, result, lease))


class BufferedRounds:
    """FedBuff's mode: needs an aggregator that is :class:`Buffering` and
    :class:`StalenessWeighted`."""

    async def run(self, ctx: RoundContext) -> None:
        aggregator = ctx.aggregator
        if not isinstance(aggregator, Buffering) or not isinstance(aggregator, StalenessWeighted):
            raise FlotillaError(
                f"strategy {ctx.spec.aggregation.strategy!r} cannot run buffered rounds"
            )
        aggregator.begin(ctx.job.rounds_committed, await ctx.global_model())
        arrivals: asyncio.Queue[_Arrival] = asyncio.Queue()
        #: Each dispatch's reader, and its lease.
        readers: dict[asyncio.Task[None], Lease[Dispatched]] = {}
        #: Device -> the lease it trains under.
        training: dict[str, Lease[Dispatched]] = {}
        tally = RoundTally()
        started = ctx.clock()
        try:
            while ctx.job.rounds_committed < ctx.job.rounds_total:
                _top_up(ctx, training, readers, arrivals)
                try:
                    arrival = await asyncio.wait_for(arrivals.get(), timeout=ctx.config.idle_poll_s)
                except asyncio.TimeoutError:
                    continue
                _take(ctx, arrival, training, tally)
                del arrival
                if not aggregator.ready():
                    continue
                tally.decisions.append(
                    f"buffer full: {len(tally.accepted)} updates, {len(tally.stale)} trained "
                    "on an older model"
                )
                try:
                    await ctx.commit(ctx.job.rounds_committed + 1, started, tally)
                except UpdateRejected as exc:
                    # FedBuff dropped the buffer and kept the current model: carry on, up
                    # to the engine's limit of refusals in a row.
                    ctx.refused(ctx.job.rounds_committed + 1, exc)
                tally = RoundTally()
                started = ctx.clock()
        finally:
            running = dict(readers)
            for reader in running:
                reader.cancel()
            for reader, lease in running.items():
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
                # A reader cancelled before it first ran never closed its stream.
                await lease.work.results.aclose()
            _refuse_unread(arrivals)
            for device_id, lease in training.items():
                lease.free([device_id])


def _refuse_unread(arrivals: asyncio.Queue[_Arrival]) -> None:
    """Answer the updates read but not folded when the job ended, and let their devices go
    (their senders would otherwise wait out their verdict timeout)."""
    while not arrivals.empty():
        arrival = arrivals.get_nowait()
        result = arrival.result
        if isinstance(result, Delivered):
            result.settle("stale: the job ended before this update was aggregated")
        arrival.lease.free(list(senders(result)))


def _take(
    ctx: RoundContext, arrival: _Arrival, training: dict[str, Lease[Dispatched]], tally: RoundTally
) -> None:
    """Free the arrival's device, fold its result and tell the scheduler."""
    result = arrival.result
    (device_id,) = senders(result)  # buffered rounds are never handed folded updates
    training.pop(device_id, None)
    arrival.lease.free([device_id])
    staleness = ctx.job.rounds_committed - arrival.version
    one = RoundTally(selected=(device_id,))  # this arrival alone, for the scheduler
    ctx.fold(result, one, staleness=staleness)
    tally.merge(one)
    ctx.observe(one, arrival.version + 1, (device_id,))


def _top_up(
    ctx: RoundContext,
    training: dict[str, Lease[Dispatched]],
    readers: dict[asyncio.Task[None], Lease[Dispatched]],
    arrivals: asyncio.Queue[_Arrival],
) -> None:
    """Dispatch the newest model to idle devices until ``clients_per_round`` are training."""
    free = ctx.spec.job.clients_per_round - len(training)
    grant = ctx.grant_now(free) if free > 0 else None  # not devices granted to other jobs
    if grant is None:
        return
    version = ctx.job.rounds_committed
    lease = ctx.dispatch(grant, lambda _: ctx.task(version + 1, ctx.clock()))
    if lease is None:
        return
    for device_id in lease.devices:
        training[device_id] = lease
    reader = asyncio.ensure_future(_drain(lease, version, ctx, arrivals))
    readers[reader] = lease

    def finished(done: asyncio.Task[None]) -> None:
        readers.pop(done, None)
        # Devices of this dispatch that never reported no longer count as training; the
        # gateway frees them when they poll again.
        for device_id in lease.devices:
            training.pop(device_id, None)

    reader.add_done_callback(finished)
