"""Secure rounds (SecAgg+): select and dispatch as synchronous rounds do, then drive the
stages of one :class:`~flotilla.secagg.SecAggServer` and commit the unmasked sum.

The server never sees an individual update: the devices' masked vectors add up to the
weighted sum of their quantized updates, whose mean is folded into the job's aggregator
as one update of weight ``total_weight`` (FedAvg and FedOpt then see exactly the weighted
mean; DP-FedAvg, a :class:`~flotilla.aggregation.SecurelySummed`, the sum of updates its
devices clipped, and adds its noise after unmasking). A round that cannot unmask (fewer
than ``threshold`` of a neighbourhood left) commits nothing and is tried again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Sequence

from flotilla.aggregation import SecurelySummed
from flotilla.core.errors import FlotillaError, SpecError
from flotilla.core.events import failure_reason
from flotilla.core.flat import flat_length, unflatten
from flotilla.core.records import ParticipationRecord
from flotilla.core.round_config import SecurePlan
from flotilla.engine.backend import Delivered, Failed, ResultStream, TrainTask, senders
from flotilla.engine.context import RoundContext
from flotilla.engine.stages import DeviceKeys, StageExchange
from flotilla.engine.sync_round import commit_or_roll_back
from flotilla.engine.tally import RoundTally, grant_decisions, next_result
from flotilla.secagg import MaskedSum, SecAggAborted, SecAggConfig, Session, Stage

log = logging.getLogger(__name__)


def secure_task(task: TrainTask, plan: SecurePlan, exchange: StageExchange) -> TrainTask:
    """``task`` telling its devices to run the secure round ``plan`` instead of uploading."""
    config = json.loads(task.order.config_json)
    config["secagg"] = plan.to_dict()
    order = dataclasses.replace(task.order, config_json=json.dumps(config, sort_keys=True))
    return dataclasses.replace(task, order=order, secagg=exchange)


def secure_plan(ctx: RoundContext, participants: Sequence[str]) -> SecurePlan:
    """What the round's devices are told: DP-FedAvg's devices clip to its norm and weigh
    their updates alike (it is unweighted); others weigh by their samples."""
    dp = ctx.spec.aggregation.strategy == "dp_fedavg"
    clip = float(getattr(ctx.plan.strategy_params, "clip_norm", 0.0)) if dp else 0.0
    weighting = "one" if dp else "samples"
    return SecurePlan(ctx.spec.privacy, tuple(participants), weighting, clip)


class SecureRounds:
    """``privacy.secure_aggregation``: one SecAgg+ round at a time."""

    def __init__(self, keys: DeviceKeys | None) -> None:
        """``keys``: where the devices' identity keys are read (None: this backend has
        none, so every secure round fails)."""
        self._keys = keys

    async def run(self, ctx: RoundContext) -> None:
        if self._keys is None:
            raise FlotillaError(
                "privacy.secure_aggregation needs the devices' identity keys; this backend "
                "has none (simulations cannot run secure rounds)"
            )
        while ctx.job.rounds_committed < ctx.job.rounds_total:
            if not await self.run_round(ctx, ctx.job.rounds_committed + 1):
                await asyncio.sleep(ctx.config.retry_pause_s)

    async def run_round(self, ctx: RoundContext, round_no: int) -> bool:
        """One attempt at a secure round; True when it committed."""
        assert self._keys is not None
        keys = self._keys
        global_state = await ctx.global_model()
        grant, rate = await ctx.select()
        started = ctx.clock()
        exchanges: list[StageExchange] = []

        def make_task(devices: Sequence[str]) -> TrainTask:
            task = ctx.task(round_no, started)
            plan = secure_plan(ctx, devices)
            session = Session(ctx.job.id, round_no, plan.participants)
            config = SecAggConfig.from_privacy(ctx.spec.privacy, len(devices))
            deadline = task.order.deadline
            exchange = StageExchange(
                config, session, keys, flat_length(task.layout), lambda: deadline - ctx.clock()
            )
            exchanges.append(exchange)
            return secure_task(task, plan, exchange)

        try:
            lease = ctx.dispatch(grant, make_task)
        except SpecError as exc:  # too few devices for the job's neighbours (freed again)
            log.warning("job %s round %d: cannot start a secure round: %s", ctx.job.id,
                        round_no, exc)  # fmt: skip
            ctx.retried(round_no, "secagg")
            return False
        if lease is None:
            ctx.retried(round_no, "no_devices")
            return False
        exchange = exchanges[-1]
        aggregator = ctx.aggregator
        aggregator.begin(round_no, global_state)
        del global_state
        decisions = grant_decisions(grant, ctx.spec.scheduling.selector)
        tally = RoundTally(schedule=grant.metrics(), decisions=decisions)
        task = lease.work.task
        masked: MaskedSum | None = None
        try:
            async with contextlib.aclosing(lease.work.results) as results:
                watch = asyncio.ensure_future(_watch(ctx, results, task, exchange, tally))
                try:
                    masked = await _stages(ctx, exchange, task)
                except SecAggAborted as exc:
                    decisions.append(f"aborted: {exc.reason}")
                    log.warning(
                        "job %s round %d: secure round aborted (%s); retrying",
                        ctx.job.id, round_no, exc.reason,
                    )  # fmt: skip
                finally:
                    watch.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await watch
                    exchange.abort("the round closed")
        finally:
            # Free who is done with the round: devices that failed, and survivors. One
            # that fell silent may still be training; the backend frees it when it polls.
            reported = set(tally.failures)
            _account(ctx, exchange, tally, masked, started)
            lease.free(reported | (set(masked.survivors) if masked is not None else set()))
        tally.close(lease.devices, full=masked is not None)
        ctx.observe(tally, round_no, lease.devices)
        quorum = min(ctx.spec.job.min_quorum, len(lease.devices))
        if masked is None or len(masked.survivors) < quorum:
            await ctx.rollback()
            ctx.retried(round_no, "secagg" if masked is None else "quorum")
            return False
        decisions.append(
            f"unmasked the sum of {len(masked.survivors)} of {len(lease.devices)} "
            f"(total weight {masked.total_weight})"
        )
        return await commit_or_roll_back(
            ctx, round_no, started, tally, rate, lambda: _fold(ctx, exchange, masked, task)
        )


async def _stages(ctx: RoundContext, exchange: StageExchange, task: TrainTask) -> MaskedSum:
    """Drive every stage: the first closes at the round's deadline (devices train first),
    each later one after ``stage_timeout_s``."""
    stage_s = ctx.spec.privacy.stage_timeout_s
    await exchange.run_stage(task.order.deadline - ctx.clock())
    for _ in range(Stage.UNMASK - Stage.ADVERTISE):
        await exchange.run_stage(stage_s)
    return await asyncio.to_thread(exchange.result)


async def _watch(
    ctx: RoundContext,
    results: ResultStream,
    task: TrainTask,
    exchange: StageExchange,
    tally: RoundTally,
) -> None:
    """Devices that fail, leave or go silent mid-round leave the exchange at once, so no
    stage waits for them. (Nothing else arrives: secure devices upload nothing.)"""
    while True:
        # Bounded by the longest the stages can last; the driver cancels this sooner.
        last = task.order.deadline + len(Stage) * ctx.spec.privacy.stage_timeout_s
        result = await next_result(results, last - ctx.clock())
        if result is None:
            return
        if isinstance(result, Failed):
            exchange.drop(result.device_id)
            tally.fail(result.device_id, failure_reason(result.reason))
        elif isinstance(result, Delivered):  # an upload in a secure round: never folded
            result.settle("a secure round takes no uploads, only its stage messages")
            exchange.drop(result.update.device_id)
            tally.fail(result.update.device_id, "refused")
        else:
            for device_id in senders(result):
                exchange.drop(device_id)
                tally.fail(device_id, "refused")


def _account(
    ctx: RoundContext,
    exchange: StageExchange,
    tally: RoundTally,
    masked: MaskedSum | None,
    started: float,
) -> None:
    """The round's record: devices whose masked input is in the sum as participants (their
    sample counts stay secret); devices that dropped out as failures, and the stage each
    left in among the decisions (one that left after its masked input is both)."""
    survivors = set(masked.survivors) if masked is not None else set()
    now = ctx.clock()
    for device_id in exchange.participants:
        if device_id in survivors:  # its masked input is in the sum
            tally.durations[device_id] = now - started
            tally.accepted.append(
                ParticipationRecord(
                    ctx.job.id, exchange.session.round, device_id, 0, started, now, {}
                )
            )
        stage = exchange.dropped.get(device_id)
        if stage is not None:
            counted = " (its masked input is in the sum)" if device_id in survivors else ""
            tally.decisions.append(f"{device_id} dropped out at {stage.name}{counted}")
        if device_id not in survivors and device_id not in tally.reasons:
            tally.fail(device_id, "dropped")
    if masked is not None:
        tally.metrics["secagg_survivors"] = float(len(masked.survivors))
        tally.metrics["secagg_total_weight"] = float(masked.total_weight)


def _fold(ctx: RoundContext, exchange: StageExchange, masked: MaskedSum, task: TrainTask) -> None:
    """The unmasked sum into the job's aggregator, as one update."""
    mean = unflatten(masked.mean(exchange.config), task.layout)
    aggregator = ctx.aggregator
    if isinstance(aggregator, SecurelySummed):
        count = len(masked.survivors)
        total = {name: value * float(masked.total_weight) for name, value in mean.items()}
        aggregator.add_sum(total, count)
    else:
        aggregator.add(mean, float(masked.total_weight))
