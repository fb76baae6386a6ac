"""Server-less rounds (``[aggregation] transport = "p2p"``): the devices average, the
server only selects, checks agreement and commits.

Each selected device trains, all-reduces its weighted update with the others over hivemind
(its group is named by the round token, reached through the server's rendezvous peers),
builds the next model and reports its SHA-256 with the group's members. The server asks
one reporter per hash to upload the average, rebuilds the model from it with the same
arithmetic as the devices, and commits it only when a quorum of reports name that hash.
Updates never cross the server's uplink one by one; the round's record says who
contributed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass, field

from flotilla.compression import apply_average
from flotilla.core.allreduce import GroupPlan
from flotilla.core.errors import FlotillaError, UpdateRejected
from flotilla.core.events import failure_reason
from flotilla.core.records import ParticipationRecord
from flotilla.core.tensors import ModelState, state_sha256
from flotilla.engine.backend import (
    Delivered,
    Failed,
    Folded,
    Reported,
    RoundResult,
    TrainTask,
    senders,
)
from flotilla.engine.context import RoundContext
from flotilla.engine.services import P2PPeers
from flotilla.engine.tally import RoundTally, grant_decisions, next_result

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Agreed:
    """The model a quorum of devices reported, rebuilt here from an uploaded average."""

    sha256: str
    model: ModelState
    supporters: tuple[Reported, ...]


@dataclass(slots=True)
class Agreement:
    """Reports and uploads of one round attempt, until a quorum agrees on a model."""

    base: ModelState
    quorum: int
    selected: Collection[str]
    server_lr: float = 1.0
    reports: dict[str, Reported] = field(default_factory=dict)
    models: dict[str, ModelState] = field(default_factory=dict)
    #: Bytes of the upload each model was rebuilt from: all the server took in for it.
    upload_bytes: dict[str, float] = field(default_factory=dict)

    def winner(self) -> Agreed | None:
        for sha, model in self.models.items():
            supporters = tuple(r for r in self.reports.values() if r.model_sha256 == sha)
            if len(supporters) >= self.quorum:
                return Agreed(sha, model, supporters)
        return None

    def problem(self, report: Reported) -> str | None:
        """Why a report cannot count, or None."""
        members = [c.device_id for c in report.contributors]
        if report.device_id not in members:
            return "a report must name its sender among the contributors"
        if len(set(members)) != len(members):
            return "a report names a contributor twice"
        strangers = sorted(set(members) - set(self.selected))
        if strangers:
            return f"contributors {strangers} were not selected for this round"
        return None

    def rebuild(self, average: ModelState) -> tuple[str, ModelState]:
        model = apply_average(self.base, average, self.server_lr)
        return state_sha256(model), model

    async def collect(
        self,
        results: AsyncIterator[RoundResult],
        deadline: float,
        clock: Callable[[], float],
        tally: RoundTally,
    ) -> Agreed | None:
        while (agreed := self.winner()) is None:
            result = await next_result(results, deadline - clock())
            if result is None:
                return None
            if isinstance(result, Failed):
                tally.fail(result.device_id, failure_reason(result.reason))
            elif isinstance(result, Reported):
                self._take_report(result, tally)
            elif isinstance(result, Folded):  # never asked for: a server-less round
                for device_id in senders(result):
                    tally.fail(device_id, "refused")
            else:
                await self._take_upload(result)
            del result
        return agreed

    def _take_report(self, report: Reported, tally: RoundTally) -> None:
        problem = self.problem(report)
        if problem is not None:
            log.warning("report of %s refused: %s", report.device_id, problem)
            tally.fail(report.device_id, "refused")
            return
        self.reports[report.device_id] = report
        tally.durations[report.device_id] = report.elapsed_s

    async def _take_upload(self, result: Delivered) -> None:
        device_id = result.update.device_id
        if not result.wanted():
            return
        report = self.reports.get(device_id)
        if report is None:
            result.settle("report the agreed model before uploading its average")
            return
        try:
            sha, model = await asyncio.to_thread(self.rebuild, result.update.delta)
        except FlotillaError as exc:
            result.settle(str(exc))
            return
        if sha != report.model_sha256:
            result.settle(
                f"the uploaded average rebuilds model {sha[:12]}, not the reported "
                f"{report.model_sha256[:12]}"
            )
            return
        self.models[sha] = model
        self.upload_bytes[sha] = float(result.update.metrics.get("bytes_up", 0.0))
        result.settle(None)

    def participation(
        self, agreed: Agreed, job_id: str, round_no: int, now: float
    ) -> list[ParticipationRecord]:
        """One record per contributor the agreeing group named (all were selected)."""
        first = agreed.supporters[0]
        started = now - max(r.elapsed_s for r in agreed.supporters)
        return [
            ParticipationRecord(
                job_id=job_id,
                round=round_no,
                device_id=c.device_id,
                num_samples=c.num_samples,
                started_at=started,
                finished_at=now,
                metrics=dict(c.metrics),
            )
            for c in first.contributors
        ]


def group_plan(
    ctx: RoundContext, p2p: P2PPeers, peers: tuple[str, ...], selected: Sequence[str]
) -> GroupPlan:
    spec = ctx.spec
    quorum = min(spec.job.min_quorum, len(selected))
    return GroupPlan(
        initial_peers=peers,
        group_size=len(selected),
        min_group_size=max(1, quorum),
        matchmaking_s=spec.aggregation.matchmaking_s,
        compression=spec.compression.uplink,
        server_lr=float(getattr(ctx.plan.strategy_params, "server_lr", 1.0)),
        members=p2p.members(selected),
    )


def with_plan(task: TrainTask, plan: GroupPlan) -> TrainTask:
    config = json.loads(task.order.config_json)
    config["p2p"] = plan.to_dict()
    order = dataclasses.replace(task.order, config_json=json.dumps(config, sort_keys=True))
    return dataclasses.replace(task, order=order, transport="p2p")


class P2PRounds:
    """Server-less rounds: needs a backend with rendezvous peers (``ctx.p2p``)."""

    async def run(self, ctx: RoundContext) -> None:
        p2p = ctx.p2p
        if p2p is None:
            raise FlotillaError(
                'aggregation.transport = "p2p" needs a server with hivemind (the p2p extra); '
                "this backend has no rendezvous peers"
            )
        while ctx.job.rounds_committed < ctx.job.rounds_total:
            if not await self.run_round(ctx, p2p, ctx.job.rounds_committed + 1):
                await asyncio.sleep(ctx.config.retry_pause_s)

    async def run_round(self, ctx: RoundContext, p2p: P2PPeers, round_no: int) -> bool:
        """One attempt at a server-less round; True when it committed."""
        peers = await p2p.peers()
        base = await ctx.global_model()
        grant, rate = await ctx.select()
        started = ctx.clock()
        plans: list[GroupPlan] = []

        def make_task(selected: Sequence[str]) -> TrainTask:
            plans.append(group_plan(ctx, p2p, peers, selected))
            return with_plan(ctx.task(round_no, started), plans[0])

        lease = ctx.dispatch(grant, make_task)
        if lease is None:
            ctx.retried(round_no, "no_devices")
            return False
        plan, selected = plans[0], lease.devices
        decisions = grant_decisions(grant, ctx.spec.scheduling.selector)
        tally = RoundTally(schedule=grant.metrics(), decisions=decisions)
        agreement = Agreement(base, plan.min_group_size, set(selected), plan.server_lr)
        job_id = ctx.job.id
        try:
            async with contextlib.aclosing(lease.work.results) as results:
                agreed = await agreement.collect(
                    results, lease.work.task.order.deadline, ctx.clock, tally
                )
        finally:
            lease.free(tally.done())
        if agreed is not None:
            tally.accepted = agreement.participation(agreed, job_id, round_no, ctx.clock())
            tally.metrics.update(_agreement_metrics(agreed, agreement))
            decisions.append(
                f"{len(agreed.supporters)} of {len(agreement.reports)} reports agreed on "
                f"model {agreed.sha256[:12]} (quorum {plan.min_group_size})"
            )
        tally.close(selected, full=agreed is not None)
        ctx.observe(tally, round_no, selected)
        if agreed is None:
            ctx.retried(round_no, "no_agreement")
            hashes = {r.model_sha256[:12] for r in agreement.reports.values()}
            log.warning(
                "job %s round %d: no quorum of %d agreeing reports (%d reports, models %s); "
                "retrying",
                job_id,
                round_no,
                plan.min_group_size,
                len(agreement.reports),
                sorted(hashes),
            )
            return False
        try:
            await ctx.commit(round_no, started, tally, rate, agreed.model, agreed.sha256)
        except UpdateRejected as exc:
            ctx.refused(round_no, exc)
            return False
        return True


def _agreement_metrics(agreed: Agreed, agreement: Agreement) -> dict[str, float]:
    return {
        "p2p_contributors": float(len(agreed.supporters[0].contributors)),
        "p2p_reports": float(len(agreed.supporters)),
        "p2p_models_reported": float(len({r.model_sha256 for r in agreement.reports.values()})),
        "allreduce_s": max(r.allreduce_s for r in agreed.supporters),
        "allreduce_reverted": float(max(r.reverted for r in agreed.supporters)),
        "bytes_up": agreement.upload_bytes.get(agreed.sha256, 0.0),
    }
