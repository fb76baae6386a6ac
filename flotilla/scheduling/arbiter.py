"""The multi-job arbiter: jobs that need devices at the same moment get them jointly.

Without it the job whose loop happens to run first takes every idle device it wants, and a
second job waits for that round to end, again and again. Here every job that is ready to
start a round is decided in one pass: oldest request first, each taking at most an equal
share of the devices still free for its task (but its quorum where there is one), chosen by
its own selector. When several jobs are decided together and could use the same devices,
one assignment first gives each contested device to the job it is relatively fastest for
(a min-cost matching of predicted times, each job's relative to its own median), so the
oldest job does not take the devices another depends on while it had others as good. Jobs
whose rounds are running (they will ask again soon) take part too, with what the deciding
jobs leave: a job deciding alone then leaves idle the devices a running job needs most,
when it has others as good for itself. Devices handed out are reserved until the job
redeems its grant (through :class:`~flotilla.scheduling.leases.Leases`, right as it
dispatches), so no decision hands one device to two jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from flotilla.core.device import DeviceProfile
from flotilla.core.eligibility import EligibilitySection
from flotilla.scheduling.duration import DurationModel
from flotilla.scheduling.pool import DevicePool
from flotilla.scheduling.selector import Selector


@dataclass(frozen=True, slots=True)
class DeviceRequest:
    job_id: str
    task: str
    #: Devices the round asks for (clients per round x over-selection).
    want: int
    #: Fewest it can run with; after ``grace_s`` of waiting, that many are enough.
    min_quorum: int
    selector: Selector
    #: The job's ``[eligibility]``: devices it excludes are never candidates.
    policy: EligibilitySection | None = None


@dataclass(slots=True)
class Grant:
    """Devices handed to one job, and how the decision went (recorded with the round)."""

    job_id: str
    devices: list[str]
    waited_s: float
    #: Jobs decided in the same pass (1: nobody else was waiting).
    contenders: int
    #: Idle devices this job could use when it was decided.
    candidates: int
    #: CPU seconds the job's selector took to choose.
    select_cpu_s: float = 0.0
    _arbiter: Arbiter | None = field(default=None, repr=False)

    def redeem(self) -> list[str]:
        """End the reservation once: the devices still reserved for this job (none when the
        grant was released or redeemed before). Leases claims them in the same step."""
        if self._arbiter is None:
            return []
        arbiter, self._arbiter = self._arbiter, None
        return arbiter.unreserve(self)

    def metrics(self) -> dict[str, float]:
        return {
            "sched_wait_s": self.waited_s,
            "sched_contenders": float(self.contenders),
            "sched_candidates": float(self.candidates),
            "sched_selected": float(len(self.devices)),
            # CPU time varies run to run: "wall" keys are left out when runs are compared.
            "wall_sched_cpu_s": self.select_cpu_s,
        }


@dataclass(slots=True)
class _Waiter:
    request: DeviceRequest
    since: float
    future: asyncio.Future[Grant]


class Arbiter:
    """Hands idle devices of one :class:`DevicePool` to the jobs asking for them."""

    def __init__(
        self,
        pool: DevicePool,
        clock: Callable[[], float],
        grace_s: float = 2.0,
        poll_s: float = 0.1,
        joint: bool = True,
    ) -> None:
        """``joint``: contested devices are assigned jointly (the module doc); False leaves
        each job to choose in turn from what older ones left."""
        self.pool = pool
        self._joint = joint
        self._clock = clock
        self._grace_s = grace_s
        self._poll_s = poll_s
        self._waiting: dict[str, _Waiter] = {}
        #: Device -> job it was granted to and has not claimed yet.
        self._reserved: dict[str, str] = {}
        #: Each job's last request and the devices it was granted: while any of them still
        #: serves it, its round is running and it will ask again.
        self._last: dict[str, tuple[DeviceRequest, tuple[str, ...]]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def idle(self, task: str, policy: EligibilitySection | None = None) -> list[DeviceProfile]:
        """Idle devices for ``task`` (that ``policy`` admits) that no job has been granted."""
        return [p for p in self.pool.idle(task, policy) if p.device_id not in self._reserved]

    def is_free(self, device_id: str) -> bool:
        """Online, serving no job, and granted to none."""
        return (
            self.pool.is_online(device_id)
            and self.pool.busy_with(device_id) is None
            and device_id not in self._reserved
        )

    def _asked(self) -> Counter[str]:
        asked: Counter[str] = Counter()
        for waiter in self._waiting.values():
            if not waiter.future.done():
                asked[waiter.request.task] += waiter.request.want
        return asked

    def shortfall(self) -> dict[str, int]:
        """Devices the waiting jobs lack, per task: what they ask for beyond the idle
        devices of their task (what a deployment's other servers may send)."""
        lacking = {task: n - len(self.idle(task)) for task, n in self._asked().items()}
        return {task: n for task, n in lacking.items() if n > 0}

    def surplus(self, task: str) -> int:
        """Idle devices of ``task`` beyond what the waiting jobs ask for (those this server
        may send to another of its deployment)."""
        return len(self.idle(task)) - self._asked()[task]

    async def acquire(self, request: DeviceRequest) -> Grant:
        """Wait until the job can start a round; its devices come reserved for it."""
        if request.job_id in self._waiting:
            raise RuntimeError(f"job {request.job_id} is already waiting for devices")
        future: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
        self._waiting[request.job_id] = _Waiter(request, self._clock(), future)
        self._wake.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.ensure_future(self._run())
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(future.result())  # granted, but nobody will claim it
            raise
        finally:
            waiter = self._waiting.get(request.job_id)
            if waiter is not None and waiter.future is future:
                del self._waiting[request.job_id]

    async def _run(self) -> None:
        """Decide whenever jobs are waiting: at once for a new request (with any others
        made at the same moment), else every ``poll_s`` as devices come free."""
        while self._waiting:
            await asyncio.sleep(0)
            self._wake.clear()
            self.decide()
            if self._waiting:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._poll_s)

    def decide(self) -> list[Grant]:
        now = self._clock()
        ready = [
            w for w in self._waiting.values() if not w.future.done() and self._is_ready(w, now)
        ]
        ready.sort(key=lambda w: (w.since, w.request.job_id))
        started = time.process_time()
        running = self._running(ready) if self._joint else []
        contend = self._joint and (len(ready) > 1 or bool(ready and running))
        elsewhere = self._assign([w.request for w in ready], running) if contend else {}
        # The assignment's CPU is shared by the jobs it decided for.
        assign_cpu = (time.process_time() - started) / max(len(ready), 1)
        grants = []
        for i, waiter in enumerate(ready):
            req = waiter.request
            candidates = self.idle(req.task, req.policy)
            if len(candidates) < req.min_quorum:
                continue  # devices went to older requests; wait for the next pass
            cap = _cap(req, len(candidates), len(ready) - i - 1)
            theirs = elsewhere.get(req.job_id, frozenset())
            mine = [c for c in candidates if c.device_id not in theirs]
            cpu = time.process_time()
            try:
                chosen = req.selector.select(
                    req.job_id, mine if len(mine) >= min(cap, len(candidates)) else candidates, cap
                )
            except Exception as exc:  # the job fails; the arbiter serves the others
                del self._waiting[req.job_id]
                waiter.future.set_exception(exc)
                continue
            cpu = time.process_time() - cpu + assign_cpu
            for device_id in chosen:
                self._reserved[device_id] = req.job_id
            self._last[req.job_id] = (req, tuple(chosen))
            grant = Grant(
                req.job_id, chosen, now - waiter.since, len(ready), len(candidates), cpu, self
            )
            grants.append(grant)
            del self._waiting[req.job_id]
            waiter.future.set_result(grant)
        return grants

    def _running(self, ready: list[_Waiter]) -> list[DeviceRequest]:
        """Requests of the jobs not deciding now whose last round still holds a device (a
        job that finished holds none, and is forgotten)."""
        deciding = {w.request.job_id for w in ready}
        out = []
        for job_id, (req, devices) in list(self._last.items()):
            if not any(self.pool.busy_with(d) == job_id for d in devices):
                del self._last[job_id]
            elif job_id not in deciding:
                out.append(req)
        return out

    def _assign(
        self, deciding: list[DeviceRequest], running: list[DeviceRequest]
    ) -> dict[str, frozenset[str]]:
        """Per deciding job: the devices one assignment gave to other jobs (deciding ones
        first, each up to what it may take; running ones share what is left)."""
        from scipy.optimize import linear_sum_assignment  # scipy: only when jobs contend

        columns: list[str] = []  # one per device a job may take: its job id
        candidates: dict[str, list[DeviceProfile]] = {}
        requests = {r.job_id: r for r in (*deciding, *running)}
        for i, req in enumerate(deciding):
            candidates[req.job_id] = self.idle(req.task, req.policy)
            columns += [req.job_id] * _cap(req, len(candidates[req.job_id]), len(deciding) - i - 1)
        for req in running:
            candidates[req.job_id] = self.idle(req.task, req.policy)
        rows = sorted({c.device_id for mine in candidates.values() for c in mine})
        spare = (len(rows) - len(columns)) // max(len(running), 1)
        for req in running:
            columns += [req.job_id] * min(req.want, max(spare, 0))
        wanted = [c.device_id for job in set(columns) for c in candidates[job]]
        if len(wanted) == len(set(wanted)):
            return {}  # no device is wanted by two jobs
        index = {d: i for i, d in enumerate(rows)}
        cost = np.full((len(rows), len(columns)), _UNUSABLE)
        for job_id in set(columns):
            mine = candidates[job_id]
            model = DurationModel(self.pool.history, self.pool.profile, task=requests[job_id].task)
            slow = np.log(model.predict(job_id, mine).seconds())
            relative = slow - float(np.median(slow))
            cols = [j for j, owner in enumerate(columns) if owner == job_id]
            at = [index[c.device_id] for c in mine]
            cost[np.ix_(at, cols)] = relative[:, None]
        picked_rows, picked_cols = linear_sum_assignment(cost)
        given: dict[str, set[str]] = {job_id: set() for job_id in candidates}
        for r, c in zip(picked_rows.tolist(), picked_cols.tolist(), strict=True):
            if cost[r, c] < _UNUSABLE:
                given[columns[c]].add(rows[r])
        everyone = set().union(*given.values())
        return {req.job_id: frozenset(everyone - given[req.job_id]) for req in deciding}

    def _is_ready(self, waiter: _Waiter, now: float) -> bool:
        req = waiter.request
        free = len(self.idle(req.task, req.policy))
        if free >= req.want:
            return True
        return free >= req.min_quorum and now - waiter.since >= self._grace_s

    def unreserve(self, grant: Grant) -> list[str]:
        """Drop ``grant``'s reservations; returns the devices that were still its own."""
        mine = [d for d in grant.devices if self._reserved.get(d) == grant.job_id]
        for device_id in mine:
            del self._reserved[device_id]
        return mine

    def release(self, grant: Grant) -> None:
        """Give back a grant that will not be redeemed (the job stopped)."""
        grant.redeem()

    def grant_now(
        self,
        job_id: str,
        task: str,
        want: int,
        selector: Selector,
        policy: EligibilitySection | None = None,
    ) -> Grant | None:
        """Up to ``want`` of the idle devices (that ``policy`` admits) no job has been
        granted, chosen by ``selector``, reserved for ``job_id`` at once; None when there
        are none. For modes that top up devices as they come free instead of waiting for a
        round."""
        candidates = self.idle(task, policy) if want > 0 else []
        if not candidates:
            return None
        cpu = time.process_time()
        chosen = selector.select(job_id, candidates, want)
        if not chosen:
            return None
        for device_id in chosen:
            self._reserved[device_id] = job_id
        cpu = time.process_time() - cpu
        return Grant(job_id, chosen, 0.0, 1, len(candidates), cpu, self)

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task


#: Cost of a device for a job that cannot use it (far above any log-time difference).
_UNUSABLE = 1e6


def _cap(req: DeviceRequest, candidates: int, later: int) -> int:
    """Devices a job may take: what it wants, at most an equal share with the ``later``
    jobs of the pass, but its quorum where there is one."""
    return min(req.want, max(candidates // (later + 1), req.min_quorum))
