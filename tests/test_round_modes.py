"""Round modes are plug-ins over a public context; aggregator capabilities are protocols.

Source checks: the engine's modules form no import circle (lazy imports included), and
none of the engine, scheduling or the two backends reads another object's private
attribute, ignores a type error or probes with ``hasattr``. Behaviour: each mode, run by
a real JobRunner over the Gateway with polling agents, commits every round and leaves
every device free.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import dataclasses
import inspect
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flotilla.aggregation import (
    Buffering,
    DPFedAvg,
    FedAvg,
    FedBuff,
    PrivacyBudgeted,
    StalenessWeighted,
)
from flotilla.core.blobstore import BlobStore
from flotilla.core.device import DeviceProfile
from flotilla.core.errors import StaleRoundError, UpdateRejected
from flotilla.core.records import JobRecord, RoundCommit
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import TensorSpec, encode_state
from flotilla.core.update import Update
from flotilla.engine import EngineConfig, EngineServices, JobPlan, JobRunner, round_mode
from flotilla.engine.buffered import BufferedRounds
from flotilla.engine.p2p_round import P2PRounds
from flotilla.engine.sync_round import SyncRounds
from flotilla.scheduling import Arbiter, DevicePool, Leases, RandomSelector
from flotilla.server.federation.gateway import Gateway

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1] / "flotilla"
TASK = "pkg.mod:Task"
LAYOUT = (TensorSpec("w", "F32", (4,)),)


# --- source checks --------------------------------------------------------------------------


def _imports(path: Path) -> set[str]:
    """Every flotilla module ``path`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("flotilla.")}


def test_the_engine_modules_form_no_import_circle() -> None:
    modules = {
        f"flotilla.engine.{p.stem}": p
        for p in (ROOT / "engine").glob("*.py")
        if p.stem != "__init__"
    }
    graph = {name: _imports(path) & modules.keys() for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            assert state.get(dep) != 1, f"import circle: {' -> '.join([*path, name, dep])}"
            if dep not in state:
                visit(dep, [*path, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_the_engine_imports_no_task() -> None:
    offenders = {
        p.name: sorted(m for m in _imports(p) if m.startswith("flotilla.tasks"))
        for p in (ROOT / "engine").glob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


OWNED = [
    *sorted((ROOT / "engine").glob("*.py")),
    *sorted((ROOT / "scheduling").glob("*.py")),
    ROOT / "server" / "federation" / "gateway.py",
    ROOT / "simulation" / "backend.py",
]


def private_reads(source: str) -> list[str]:
    """``x._name`` where ``x`` is not ``self`` or ``cls``, as ``line: code``."""
    return [
        f"{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
    ]


def test_the_private_check_catches_a_reach_into_another_object() -> None:
    source = "runner._aggregator.add(x)\nself._own = 1\nrunner._plan\n"
    assert sorted(r.split(":")[0] for r in private_reads(source)) == ["1", "3"]


def test_no_round_mode_or_backend_reads_another_objects_private_fields() -> None:
    offenders = {
        str(p.relative_to(ROOT.parent)): found
        for p in OWNED
        if (found := private_reads(p.read_text()))
    }
    assert offenders == {}


def test_the_engine_neither_ignores_type_errors_nor_probes_with_hasattr() -> None:
    for path in sorted((ROOT / "engine").glob("*.py")):
        text = path.read_text()
        assert "type: ignore" not in text, path.name
        calls = [
            n
            for n in ast.walk(ast.parse(text))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "hasattr"
        ]
        assert calls == [], path.name


def test_a_job_runner_takes_at_most_seven_arguments() -> None:
    params = list(inspect.signature(JobRunner.__init__).parameters)[1:]
    assert len(params) <= 7, params


# --- capabilities and modes -----------------------------------------------------------------


def test_aggregators_declare_their_capabilities_as_protocols() -> None:
    dp = DPFedAvg(LAYOUT)
    buff = FedBuff(LAYOUT)
    plain = FedAvg(LAYOUT)
    assert isinstance(dp, PrivacyBudgeted)
    assert not isinstance(dp, Buffering) and not isinstance(dp, StalenessWeighted)
    assert isinstance(buff, Buffering) and isinstance(buff, StalenessWeighted)
    assert not isinstance(buff, PrivacyBudgeted)
    for capability in (PrivacyBudgeted, Buffering, StalenessWeighted):
        assert not isinstance(plain, capability)


def _spec(strategy: str = "fedavg", rounds: int = 4, **agg: Any) -> JobSpec:
    return JobSpec.from_dict(
        {
            "job": {"task": TASK, "rounds": rounds, "clients_per_round": 3, "min_quorum": 3},
            "aggregation": {"strategy": strategy, **agg},
        }
    )


def test_the_mode_comes_from_the_plan() -> None:
    assert isinstance(round_mode(JobPlan.from_spec(_spec())), SyncRounds)
    assert isinstance(round_mode(JobPlan.from_spec(_spec("dp_fedavg"))), SyncRounds)
    buffered = _spec("fedbuff", params={"buffer_size": 2})
    assert isinstance(round_mode(JobPlan.from_spec(buffered)), BufferedRounds)
    assert isinstance(round_mode(JobPlan.from_spec(_spec(transport="p2p"))), P2PRounds)


# --- each mode, run ---------------------------------------------------------------------------


class Ledger:
    def __init__(self, job: JobRecord) -> None:
        self.job = job
        self.commits: list[RoundCommit] = []

    async def commit_round(self, commit: RoundCommit) -> JobRecord:
        assert commit.round == self.job.rounds_committed + 1, "next round only"
        self.commits.append(commit)
        state = "completed" if commit.round >= self.job.rounds_total else self.job.state
        self.job = dataclasses.replace(
            self.job,
            rounds_committed=commit.round,
            checkpoint_sha256=commit.checkpoint_sha256,
            aggregator_sha256=commit.aggregator_sha256,
            state=state,
        )
        return self.job

    async def set_job_state(self, job_id: str, state: str) -> JobRecord:
        self.job = dataclasses.replace(self.job, state=state)
        return self.job


async def _agent(gateway: Gateway, device_id: str) -> None:
    """Polls without pause; answers every task with a small update."""
    while True:
        task = await gateway.poll(device_id, 0.001)
        if task is None:
            await asyncio.sleep(0)
            continue
        delta = {"w": np.full(4, 0.01, dtype=np.float32)}
        order = task.order
        update = Update(order.job_id, order.round, device_id, 10, delta)
        with contextlib.suppress(StaleRoundError, UpdateRejected):  # as a real agent does
            rnd = gateway.expect(device_id, order.job_id, order.round, order.round_token)
            await gateway.deliver(rnd, update, 5.0)


async def _run(spec: JobSpec, tmp_path: Path, devices: Sequence[str]) -> tuple[Ledger, DevicePool]:
    pool = DevicePool(clock=time.time)
    for d in devices:
        pool.seen(DeviceProfile(d, tasks=(TASK,)))
    leases = Leases(pool)
    gateway = Gateway(pool, time.time, leases)
    blobs = BlobStore(tmp_path / "blobs")
    job = JobRecord(
        id="job-1",
        name="j",
        spec_json=spec.to_json(),
        state="pending",
        rounds_total=spec.job.rounds,
        rounds_committed=0,
        checkpoint_sha256=blobs.put(encode_state({"w": np.ones(4, dtype=np.float32)})),
        created_at=0.0,
        updated_at=0.0,
    )
    config = EngineConfig(selection_grace_s=0.01, idle_poll_s=0.01, retry_pause_s=0.01)
    arbiter = Arbiter(pool, time.time, config.selection_grace_s, config.idle_poll_s)
    ledger = Ledger(job)
    services = EngineServices(gateway, leases, arbiter, ledger, blobs, time.time, config)
    runner = JobRunner(job, spec, services, RandomSelector(random.Random(0)), evaluator=None)
    agents = [asyncio.ensure_future(_agent(gateway, d)) for d in devices]
    try:
        await asyncio.wait_for(runner.run(), timeout=30)
        # A device still training when the job ended is free once its agent is back.
        deadline = time.monotonic() + 5
        while any(pool.busy_with(d) for d in devices) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    finally:
        await arbiter.close()
        for agent in agents:
            agent.cancel()
        await asyncio.gather(*agents, return_exceptions=True)
    return ledger, pool


@pytest.mark.parametrize(
    "strategy, params",
    [("fedavg", {}), ("fedbuff", {"buffer_size": 2}), ("dp_fedavg", {"epsilon": 1e6})],
)
async def test_each_mode_commits_every_round_and_frees_every_device(
    strategy: str, params: dict[str, Any], tmp_path: Path
) -> None:
    devices = [f"d{i}" for i in range(5)]
    ledger, pool = await _run(_spec(strategy, params=params), tmp_path, devices)
    assert ledger.job.state == "completed"
    assert [c.round for c in ledger.commits] == [1, 2, 3, 4]
    assert all(c.participants for c in ledger.commits)
    if strategy == "dp_fedavg":
        epsilons = [c.metrics["epsilon"] for c in ledger.commits]
        assert epsilons == sorted(epsilons) and epsilons[0] > 0, "each round spends budget"
    assert [pool.busy_with(d) for d in devices] == [None] * 5


async def test_a_spent_privacy_budget_ends_the_job_as_completed(tmp_path: Path) -> None:
    spec = _spec("dp_fedavg", rounds=50, params={"epsilon": 3.0, "noise_multiplier": 2.0})
    devices = [f"d{i}" for i in range(5)]
    ledger, pool = await _run(spec, tmp_path, devices)
    assert ledger.job.state == "completed"
    assert 1 <= ledger.job.rounds_committed < 50, "stopped by the budget, not the round count"
    assert max(c.metrics["epsilon"] for c in ledger.commits) <= 3.0
    assert [pool.busy_with(d) for d in devices] == [None] * 5
