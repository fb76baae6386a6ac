"""Bytes to accuracy, the figure of merit of a codec, on the digits job.

Every configuration trains the same clients on the same shards with the same selection;
only the uplink codec differs. The loop uses the platform's own trainer, codecs, server
decoding and aggregator (see tests/fedloop.py), without the network in between.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flotilla.core.spec import JobSpec
from tests.fedloop import EXAMPLE, LoopResult, run_federation

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


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoopResult]:
    out = {}
    for name, sets in CONFIGS.items():
        state = Path(tmp_path_factory.mktemp(name))
        spec = JobSpec.load(EXAMPLE, sets)
        out[name] = run_federation(spec, 10, 5, ROUNDS, state_dir=state, stop_at=TARGET)
    return out


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


def test_dp_fedavg_still_learns_with_fifty_agents() -> None:
    spec = JobSpec.load(
        EXAMPLE,
        [
            "aggregation.strategy=dp_fedavg",
            "aggregation.params.noise_multiplier=0.7",
            "aggregation.params.clip_norm=0.5",
            "aggregation.params.epsilon=1000",
        ],
    )
    result = run_federation(spec, clients=50, per_round=25, rounds=10)
    assert max(result.accuracy[-3:]) > 0.4, f"chance is 0.1: {result.accuracy}"
