"""A server core and N real agents in one process and one event loop: no sockets, no
subprocesses.

The server side is what ``flotilla server`` composes, less the gRPC edge: the store, the
:class:`Federation` facade over it, the reaper. Each agent is a real
:class:`flotilla.client.Agent` (``LocalTrainer`` over ``ShardTraining``, as ``flotilla
client`` builds it) talking to the facade through :class:`flotilla.inprocess.
InProcessTransport`. What an operator sees comes from the facade through the same
conversions the gRPC edge and the CLI apply, so ``status`` returns what ``flotilla job
status --json`` prints.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flotilla.cli.remote import device_json, job_json
from flotilla.client import Agent, AgentConfig, LocalTrainer
from flotilla.client.conditions import ConditionsSource
from flotilla.core.events import EventSink
from flotilla.core.jobfile import load_job_specs
from flotilla.core.timeouts import Timeouts
from flotilla.engine import EngineConfig
from flotilla.inprocess import InProcessTransport
from flotilla.server.federation import auth
from flotilla.server.federation.budget import ByteBudget
from flotilla.server.federation.facade import Federation, FederationConfig
from flotilla.server.federation.ports import Hosted
from flotilla.server.federation.store import Store
from flotilla.server.grpc.wire import device_info_to_pb, job_info
from flotilla.server.hosting.rendezvous import HostedRendezvous
from flotilla.server.hosting.volunteers import VolunteerHost
from flotilla.tasks import Shard, ShardTraining, Task
from flotilla.tasks.runtime import LocalTasks

DIGITS = "flotilla.tasks.digits:DigitsTask"
#: What ``tests.support.processes.ServerProcess`` starts the real server with.
SERVER_TIMEOUTS = Timeouts(liveness_s=6.0)
#: The real server's upload budget (``ServerConfig``).
UPLOAD_BUDGET_BYTES = 64 * 1024 * 1024

#: Makes the task an agent trains: ``(task name, shard index, shard count) -> Task`` or
#: None to load the task by name, as ``flotilla client --task`` does.
TaskFactory = Callable[[str, int, int], Task | None]


def _by_name(task: str, index: int, count: int) -> Task | None:
    return None


@dataclass
class InProcessFederation:
    """One federation: the facade, its store and state dir, and the agents running on it."""

    federation: Federation
    store: Store
    state_dir: Path
    db_url: str
    agent_timeouts: Timeouts = field(default_factory=Timeouts)
    agents: list[Agent] = field(default_factory=list)
    _runs: list[asyncio.Task[None]] = field(default_factory=list)

    async def enrol_token(self) -> str:
        """A new enrolment token, as ``flotilla server token create`` mints one."""
        token = auth.new_secret()
        await self.store.add_enrol_token(auth.hash_secret(token))
        return token

    async def start_agents(
        self,
        count: int,
        task: str = DIGITS,
        make_task: TaskFactory = _by_name,
        conditions: Sequence[ConditionsSource] = (),
        options: Callable[[int], Mapping[str, Any]] = lambda i: {},
    ) -> list[Agent]:
        """``count`` agents on shards ``i/count``, as ``flotilla client --shard i/count``;
        agent ``i`` reads its conditions from ``conditions[i]`` (none reported without)
        and takes ``options(i)`` as further ``AgentConfig`` fields."""
        token = await self.enrol_token()
        started = []
        for i in range(count):
            training = ShardTraining(task, Shard(i, count), task=make_task(task, i, count))
            config = AgentConfig(
                server="in-process",
                token=token,
                trainer=LocalTrainer(training),
                timeouts=self.agent_timeouts,
                conditions=conditions[i] if i < len(conditions) else None,
            )
            config = dataclasses.replace(config, **options(i))
            agent = Agent(config, rng=random.Random(len(self.agents)), transport=self.transport())
            self.agents.append(agent)
            self._runs.append(asyncio.ensure_future(agent.run()))
            started.append(agent)
        return started

    def transport(self) -> InProcessTransport:
        return InProcessTransport(self.federation)

    async def submit(self, spec: Path, *overrides: str) -> str:
        """Submit as ``flotilla job submit SPEC --set ...`` does; the (last) job's id."""
        ids = [
            (await self.federation.submit_job(s.to_json())).id
            for s in load_job_specs(spec, overrides)
        ]
        return ids[-1]

    async def status(self, job_id: str, rounds: bool = False) -> dict[str, Any]:
        """What ``flotilla job status JOB --json [--rounds]`` prints."""
        detail = await self.federation.get_job(job_id, with_rounds=rounds)
        return job_json(job_info(detail.job, detail.rounds), rounds)

    async def jobs(self) -> list[dict[str, Any]]:
        """What ``flotilla job list --json`` prints."""
        return [job_json(job_info(j)) for j in await self.federation.list_jobs()]

    async def devices(self, task: str = "") -> list[dict[str, Any]]:
        """What ``flotilla devices list [--task TASK] --json`` prints."""
        infos = await self.federation.list_devices(task)
        return [device_json(device_info_to_pb(d)) for d in infos]

    async def export(self, job_id: str) -> bytes:
        """The job's latest model, as ``flotilla job export`` writes it."""
        return b"".join([piece.data async for piece in self.federation.export_model(job_id)])

    async def participations(self) -> list[Any]:
        return list(await self.store.list_participations())

    async def wait_for(
        self, job_id: str, timeout: float, states: Sequence[str] = ("completed",)
    ) -> dict[str, Any]:
        """Until the job is in one of ``states`` (or failed, cancelled); its status."""
        ended = (*states, "failed", "cancelled")
        last: list[str] = [""]

        async def done() -> bool:
            job = await self.store.get_job(job_id)
            last[0] = job.state if job is not None else "unknown"
            return last[0] in ended

        if not await poll_until(done, timeout):
            raise AssertionError(f"job {job_id} not done in {timeout}s: {last[0]}")
        return await self.status(job_id)

    async def wait_devices(self, count: int, timeout: float, state: str = "idle") -> None:
        async def ready() -> bool:
            devices = await self.federation.list_devices()
            return sum(d.state == state for d in devices) >= count

        if not await poll_until(ready, timeout):
            raise AssertionError(f"{count} devices were not {state} within {timeout}s")

    async def stop_agents(self) -> None:
        """Cancel every agent (each tells the server it leaves), and wait for them."""
        for run in self._runs:
            run.cancel()
        for run in self._runs:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(run, 10.0)
        self._runs.clear()


async def poll_until(done: Callable[[], Awaitable[bool]], timeout: float) -> bool:
    """Whether ``done()`` became true within ``timeout`` seconds (checked every 0.2 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await done():
            return True
        await asyncio.sleep(0.2)
    return False


async def _reap(federation: Federation, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        federation.reap()


@asynccontextmanager
async def in_process_federation(
    state_dir: Path,
    db_url: str,
    *,
    timeouts: Timeouts = SERVER_TIMEOUTS,
    engine: EngineConfig | None = None,
    agent_timeouts: Timeouts | None = None,
    sinks: Sequence[EventSink] = (),
    restart: bool = False,
) -> AsyncIterator[InProcessFederation]:
    """A federation on ``db_url`` (emptied first when it is PostgreSQL, unless this is a
    ``restart`` on what an earlier one left), its events sent to ``sinks``; agents started
    on it are stopped, and the core closed, on the way out."""
    state_dir.mkdir(parents=True, exist_ok=True)
    store = await Store.open(db_url)
    if store.dialect == "postgresql" and not restart:
        await store.wipe()
    rendezvous = HostedRendezvous(state_dir / "rendezvous")
    hosted = Hosted(rendezvous=rendezvous, volunteers=VolunteerHost((), state_dir / "volunteer"))
    federation = Federation(
        FederationConfig(state_dir=state_dir, timeouts=timeouts, engine=engine or EngineConfig()),
        store,
        ByteBudget(UPLOAD_BUDGET_BYTES),
        hosted,
        LocalTasks(),
        sinks=sinks,
    )
    reaper = asyncio.ensure_future(_reap(federation, min(1.0, timeouts.liveness_s / 4)))
    fed = InProcessFederation(federation, store, state_dir, db_url, agent_timeouts or Timeouts())
    try:
        await federation.start()
        yield fed
    finally:
        await fed.stop_agents()
        reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reaper
        await federation.close()
        await rendezvous.stop()
        await store.close()
