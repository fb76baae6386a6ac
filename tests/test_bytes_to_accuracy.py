"""Bytes to accuracy, the figure of merit of a codec, on the digits job.

Every configuration is a job on the same ten real agents (in one process, over the
in-process transport), each on the same shard, with the same job seed; only the uplink
codec differs. The server's engine selects five agents a round, decodes their updates,
aggregates and evaluates each new model on its held-out split; the bytes are what it
received.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.databases import database_url, deployment_database
from tests.support.inproc import InProcessFederation, in_process_federation

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits.toml"
TARGET = 0.90
ROUNDS = 40


def _topk(fraction: float, feedback: bool) -> list[str]:
    return [
        "compression.uplink=topk",
        f"compression.uplink_params.fraction={fraction}",
        f"compression.error_feedback={'true' if feedback else 'false'}",
    ]


CONFIGS: dict[str, list[str]] = {
    "none": [],
    "int8": ["compression.uplink=int8"],
    "topk10_ef": _topk(0.10, True),
    "topk5_ef": _topk(0.05, True),
    "topk1_ef": _topk(0.01, True),
    "topk1": _topk(0.01, False),
}


@dataclass
class LoopResult:
    """One job's rounds: held-out accuracy and cumulative uplink bytes after each."""

    accuracy: list[float] = field(default_factory=list)
    uplink_bytes: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, status: dict[str, Any]) -> LoopResult:
        out, spent = cls(), 0
        for r in status["rounds"]:
            spent += int(r["metrics"]["bytes_up"])
            out.accuracy.append(float(r["metrics"]["accuracy"]))
            out.uplink_bytes.append(spent)
        return out

    def bytes_to(self, target: float) -> int | None:
        """Uplink bytes spent when held-out accuracy first reached ``target``."""
        for acc, spent in zip(self.accuracy, self.uplink_bytes, strict=True):
            if acc >= target:
                return spent
        return None


async def run_job(
    fed: InProcessFederation, clients: int, per_round: int, rounds: int, *sets: str
) -> LoopResult:
    """One job of ``rounds`` rounds, ``per_round`` of ``clients`` agents each (all must
    report), on the digits example with ``sets``."""
    job_id = await fed.submit(
        EXAMPLE, *sets, f"job.rounds={rounds}", f"job.clients_per_round={per_round}",
        f"job.min_quorum={per_round}", "job.over_selection=1.0",
    )  # fmt: skip
    await fed.wait_for(job_id, timeout=300)
    return LoopResult.of(await fed.status(job_id, rounds=True))


async def run_codecs(root: Path) -> dict[str, LoopResult]:
    url = database_url(deployment_database(), root)
    async with in_process_federation(root / "state", url) as fed:
        await fed.start_agents(10)
        return {
            name: await run_job(fed, 10, 5, ROUNDS, *sets, f"job.name={name}")
            for name, sets in CONFIGS.items()
        }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoopResult]:
    return asyncio.run(run_codecs(tmp_path_factory.mktemp("codecs")))


def _bytes(runs: dict[str, LoopResult], name: str) -> int:
    spent = runs[name].bytes_to(TARGET)
    assert spent is not None, f"{name} never reached {TARGET}: {runs[name].accuracy}"
    return spent


def test_int8_reaches_the_target_with_a_quarter_of_the_bytes(runs: dict[str, LoopResult]) -> None:
    ratio = _bytes(runs, "none") / _bytes(runs, "int8")
    assert ratio >= 3.5, f"int8 saved only {ratio:.2f}x"


def test_topk_with_error_feedback_saves_eight_times(runs: dict[str, LoopResult]) -> None:
    best = min(_bytes(runs, name) for name in ("topk10_ef", "topk5_ef", "topk1_ef"))
    ratio = _bytes(runs, "none") / best
    assert ratio >= 8.0, f"the best top-k with error feedback saved only {ratio:.2f}x"


def test_without_error_feedback_topk_needs_more_bytes(runs: dict[str, LoopResult]) -> None:
    """What error feedback is for: the dropped 99% is delayed, not lost."""
    with_ef = _bytes(runs, "topk1_ef")
    without = runs["topk1"].bytes_to(TARGET)
    assert without is None or without >= 1.2 * with_ef, (with_ef, without)


async def test_dp_fedavg_still_learns_with_fifty_agents(in_process: InProcessFederation) -> None:
    await in_process.start_agents(50)
    await in_process.wait_devices(50, timeout=120)
    result = await run_job(
        in_process, 50, 25, 10,
        "aggregation.strategy=dp_fedavg", "aggregation.params.noise_multiplier=0.7",
        "aggregation.params.clip_norm=0.5", "aggregation.params.epsilon=1000",
    )  # fmt: skip
    assert max(result.accuracy[-3:]) > 0.4, f"chance is 0.1: {result.accuracy}"
