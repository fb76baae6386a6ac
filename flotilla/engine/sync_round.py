"""Synchronous rounds: select, dispatch, collect until enough updates or the deadline,
then commit the aggregate as the job's next round (or roll it back and retry)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from flotilla.core.errors import UpdateRejected
from flotilla.engine.backend import ResultStream, TrainTask
from flotilla.engine.context import RoundContext
from flotilla.engine.tally import RoundTally, grant_decisions, next_result

log = logging.getLogger(__name__)


class SyncRounds:
    """The default mode: one round at a time, each selected, collected and committed whole."""

    async def run(self, ctx: RoundContext) -> None:
        while ctx.job.rounds_committed < ctx.job.rounds_total:
            if not await self.run_round(ctx, ctx.job.rounds_committed + 1):
                await asyncio.sleep(ctx.config.retry_pause_s)

    async def run_round(self, ctx: RoundContext, round_no: int) -> bool:
        """One attempt at a round; True when it committed."""
        global_state = await ctx.global_model()
        grant, rate = await ctx.select()
        started = ctx.clock()
        lease = ctx.dispatch(grant, lambda _: ctx.task(round_no, started, foldable=True))
        if lease is None:  # every granted device went away meanwhile
            ctx.retried(round_no, "no_devices")
            return False
        aggregator = ctx.aggregator
        aggregator.begin(round_no, global_state)
        del global_state
        decisions = grant_decisions(grant, ctx.spec.scheduling.selector)
        tally = RoundTally(schedule=grant.metrics(), decisions=decisions)
        try:
            async with contextlib.aclosing(lease.work.results) as results:
                await _collect(ctx, results, lease.work.task, tally)
        finally:
            lease.free(tally.done())
        want = ctx.spec.job.clients_per_round
        tally.close(lease.devices, full=aggregator.count >= want)
        ctx.observe(tally, round_no, lease.devices)
        quorum = min(ctx.spec.job.min_quorum, len(lease.devices))
        if aggregator.count >= want:
            ended = "with enough updates"
        elif ctx.clock() >= lease.work.task.order.deadline:
            ended = "at the deadline"
        else:
            ended = "once no device owed an update"
        decisions.append(f"closed {ended}: {aggregator.count} of {want} (quorum {quorum})")
        if aggregator.count < quorum:
            log.warning(
                "job %s round %d: %d updates, below quorum %d; retrying",
                ctx.job.id,
                round_no,
                aggregator.count,
                ctx.spec.job.min_quorum,
            )
            await ctx.rollback()
            ctx.retried(round_no, "quorum")
            return False
        return await commit_or_roll_back(ctx, round_no, started, tally, rate)


async def commit_or_roll_back(
    ctx: RoundContext,
    round_no: int,
    started: float,
    tally: RoundTally,
    rate: float,
    fold: Callable[[], None] = lambda: None,
) -> bool:
    """``fold`` (what is left to add to the aggregate), then commit the round; whatever
    fails on the way rolls the aggregator back (a refused aggregate: False, and the round
    is retried; anything else propagates)."""
    try:
        fold()
        await ctx.commit(round_no, started, tally, rate)
    except UpdateRejected as exc:
        await ctx.rollback()
        ctx.refused(round_no, exc)
        return False
    except BaseException:
        await ctx.rollback()
        raise
    return True


async def _collect(
    ctx: RoundContext, results: ResultStream, task: TrainTask, tally: RoundTally
) -> None:
    want = ctx.spec.job.clients_per_round
    aggregator = ctx.aggregator
    while aggregator.count < want:
        result = await next_result(results, task.order.deadline - ctx.clock())
        if result is None:
            return
        ctx.fold(result, tally)
        del result  # do not hold a model-sized update while waiting for the next one
        await asyncio.sleep(0)  # let other jobs' handlers run between large folds
