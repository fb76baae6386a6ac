"""The scheduling benchmark's figures (benchmarks/scheduling.py): smoothed time to target,
area under the curve with the last value held, the value at a budget, the representation
index, the frontier at a selector's own fairness, and resuming a study."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports its sibling provenance
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_scheduling", ROOT / "benchmarks" / "scheduling.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_time_to_target_is_on_the_smoothed_curve(bench: ModuleType) -> None:
    times = [10.0, 20.0, 30.0, 40.0, 50.0]
    # One lucky evaluation (0.9 at 20 s) is not a crossing: the median of the last 3 is.
    values = [0.5, 0.9, 0.5, 0.85, 0.9]
    assert bench.time_to_target(times, values, 0.8, True) == 40.0
    assert bench.time_to_target(times, values, 0.95, True) is None
    bits = [5.0, 4.0, 5.0, 4.1, 4.0]
    assert bench.time_to_target(times, bits, 4.2, False) == 40.0


def test_area_under_holds_the_last_value_to_the_horizon(bench: ModuleType) -> None:
    # 0 before the first evaluation, 0.5 over [10, 20), 1.0 from 20 to the horizon.
    assert bench.area_under([10.0, 20.0], [0.5, 1.0], 40.0) == pytest.approx(25 / 40)
    # Evaluations after the horizon do not count.
    assert bench.area_under([10.0, 50.0], [0.5, 1.0], 40.0) == pytest.approx(15 / 40)
    assert bench.area_under([50.0], [1.0], 40.0) == 0.0
    assert bench.area_under([], [], 40.0) == 0.0


def test_the_value_at_a_budget_is_the_value_then_not_the_best(bench: ModuleType) -> None:
    times, values = [1.0, 2.0, 3.0], [0.9, 0.5, 0.7]
    assert bench.value_at(times, values, 2.5) == 0.5
    assert bench.value_at(times, values, 3.0) == 0.7
    assert bench.value_at(times, values, 0.5) is None


def test_scores_are_larger_is_better_for_every_job(bench: ModuleType) -> None:
    plan = bench.full_plan()
    assert plan.goal("wide").score(0.8) == 0.8
    charlm = plan.goal("charlm-a")  # a job's kind is its name up to the first "-"
    assert charlm.metric == "bits_per_char"
    assert charlm.score(4.0) > charlm.score(4.5) > 0.0
    assert charlm.score(charlm.ref + 1.0) == 0.0


def test_representation_index(bench: ModuleType) -> None:
    sizes = [10, 30, 60]
    assert bench.representation_index({0: 1.0, 1: 3.0, 2: 6.0}, sizes) == pytest.approx(1.0)
    # Only the device with 10 % of the data: its share is 1 against 0.1, TV distance 0.9.
    assert bench.representation_index({0: 5.0}, sizes) == pytest.approx(0.1)
    assert bench.representation_index({0: 1.0, 2: 1.0}, [0, 1, 0]) == pytest.approx(0.0)
    assert bench.representation_index({}, sizes) == 0.0


def test_frontier_is_interpolated_at_the_selectors_own_jain(bench: ModuleType) -> None:
    points = [(0.1, 0.9), (0.5, 0.7), (0.3, 0.6)]  # (0.3, 0.6) is dominated by (0.5, 0.7)
    value, inside = bench.frontier_at(points, 0.3)
    assert value == pytest.approx(0.8) and inside
    assert bench.frontier_at(points, 0.7) == (pytest.approx(0.7), False)
    assert bench.frontier_at(points, 0.05) == (pytest.approx(0.9), False)


def test_selector_variants_set_beta_the_arbiter_and_fairness(bench: ModuleType) -> None:
    assert bench.selector_overrides("greedy-b300") == [
        "scheduling.selector=greedy",
        "scheduling.beta=300",
    ]
    assert bench.selector_overrides("greedy") == ["scheduling.selector=greedy"]
    assert bench.selector_overrides("greedy-seq") == [
        "scheduling.selector=greedy",
        "simulation.arbiter=sequential",
    ]
    assert bench.selector_overrides("greedy+-budget") == [
        "scheduling.selector=greedy+",
        "scheduling.params.fairness=budget",
    ]


def _run(bench: ModuleType, selector: str, seed: int, plan: object, rise: float) -> dict:
    """A stored run as run_one writes it, with a made-up series."""
    series = [[10.0 * (i + 1), min(0.95, rise * (i + 1)), 0.5] for i in range(10)]
    return {
        "key": bench.run_key("unrelated", selector, seed, plan.overrides),  # type: ignore[attr-defined]
        "scenario": "unrelated",
        "selector": selector,
        "seed": seed,
        "beta": 3000.0,
        "jobs": {
            "wide": {
                "start_s": 0.0,
                "rounds": 10,
                "rounds_total": 10,
                "completed_s": 100.0,
                "representation": 0.5,
                "series": series,
            }
        },
        "jain": 0.5,
        "never_used": 0.2,
        "wasted_device_hours": 1.0,
        "sched_cpu_ms_mean": 1.0,
        "sched_cpu_ms_max": 2.0,
        "wall_seconds": 1.0,
    }


def test_resume_skips_runs_already_in_the_file(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = bench.full_plan()
    file = tmp_path / "runs.jsonl"
    runs = [_run(bench, "random", 0, plan, 0.1), _run(bench, "greedy", 0, plan, 0.2)]
    file.write_text("".join(json.dumps(r) + "\n" for r in runs) + '{"torn')
    done = bench.load_done(file)
    assert set(done) == {r["key"] for r in runs}
    small = bench.Plan(("unrelated",), ("random", "greedy", "fedcs"), (0, 1), plan.goals)
    assert bench.todo(small, done) == [
        ("unrelated", "fedcs", 0),
        ("unrelated", "random", 1),
        ("unrelated", "greedy", 1),
        ("unrelated", "fedcs", 1),
    ]
    # Everything the plan asks for is in the file: nothing is simulated, the table is made.
    args = ["--resume", str(file), "--scenarios", "unrelated", "--selectors", "random,greedy"]
    assert bench.main([*args, "--seeds", "1", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    greedy = report["table"]["unrelated"]["greedy"]
    assert greedy["vs_random"]["auc_ratio"]["median"] > 1.0
    assert greedy["jobs"]["wide"]["time_to_easy_s"] < 100.0
    assert file.read_text().count("\n") == 2, "nothing appended"
    assert {f["name"] for f in report["floors"]} == {
        "scheduler CPU ms per decision (worst selector)"
    }
