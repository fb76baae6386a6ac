"""Bytes to accuracy, the figure of merit of a codec, on the digits job.

The codecs are compared in the simulator, on the real engine: ten simulated devices, each
on the same shard, five a round, the same seeds, on a virtual clock, so every configuration
trains the same clients with the same selection and only the uplink codec differs. Each
device's update goes through the agent's pipeline (momentum, codec, error feedback) and
the server's decoding; the server's evaluator scores each new model on its held-out split;
the bytes are what the server received. Differential privacy is checked on fifty real
agents in one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from flotilla.simulation import load_experiment, run_experiment
from tests.support.databases import database_url, deployment_database
from tests.support.experiments import rows
from tests.support.inproc import InProcessFederation, in_process_federation

# One worker runs the whole module (xdist group), so its module-scoped run happens once.
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow, pytest.mark.xdist_group(__name__)]

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


def run_codecs(root: Path) -> dict[str, LoopResult]:
    """Every configuration as its own simulated experiment of ``ROUNDS`` rounds."""
    path = root / "codecs.toml"
    path.write_text(
        EXAMPLE.read_text() + "\n[population]\nclients = 10\n\n[simulation]\nseed = 0\n"
    )
    sizes = ["job.clients_per_round=5", "job.min_quorum=5", "job.over_selection=1.0"]
    out = {}
    for name, sets in CONFIGS.items():
        experiment = load_experiment(path, [f"job.rounds={ROUNDS}", *sizes, *sets])
        summary = run_experiment(experiment, root / name, progress=False)
        assert {j["state"] for j in summary["jobs"].values()} == {"completed"}, summary
        result, spent = LoopResult(), 0
        for row in rows(root / name):
            spent += int(row["bytes_up"])
            result.accuracy.append(float(row["accuracy"]))
            result.uplink_bytes.append(spent)
        out[name] = result
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoopResult]:
    return run_codecs(tmp_path_factory.mktemp("codecs"))


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


async def test_dp_fedavg_still_learns_with_fifty_agents(tmp_path: Path) -> None:
    url = database_url(deployment_database(), tmp_path)
    async with in_process_federation(tmp_path / "state", url) as fed:
        await fed.start_agents(50)
        await fed.wait_devices(50, timeout=120)
        result = await run_job(
            fed, 50, 25, 10,
            "aggregation.strategy=dp_fedavg", "aggregation.params.noise_multiplier=0.7",
            "aggregation.params.clip_norm=0.5", "aggregation.params.epsilon=1000",
        )  # fmt: skip
    assert max(result.accuracy[-3:]) > 0.4, f"chance is 0.1: {result.accuracy}"
