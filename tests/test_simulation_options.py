"""Simulator options for scheduling studies: per-job start times, noisy and throttling
devices (``[population]``), and the digits task's worst-class accuracy in a run's rows."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flotilla.core.errors import SpecError
from flotilla.core.jobfile import load_job_specs
from flotilla.simulation import PopulationSection, load_experiment, run_experiment
from flotilla.simulation.population import Slowdowns
from tests.support.experiments import experiment_file, rows
from tests.support.lifetime import bound

pytestmark = pytest.mark.timeout(300)

TWO_JOBS = """
[[jobs]]
job = { name = "early", seed = 1 }

[[jobs]]
job = { name = "late", seed = 2 }
start_s = 500.0
"""


def without_wall(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("wall")} for r in items]


def test_a_job_with_start_s_starts_no_earlier_on_the_virtual_clock(tmp_path: Path) -> None:
    path = experiment_file(tmp_path, TWO_JOBS)
    experiment = load_experiment(path, ["job.rounds=2"])
    assert experiment.starts == (0.0, 500.0)
    run_experiment(experiment, tmp_path / "out", progress=False)
    metrics = rows(tmp_path / "out")
    parts = rows(tmp_path / "out", "participation.jsonl")
    late = [p["started_at"] for p in parts if p["job"] == "late"]
    early = [p["started_at"] for p in parts if p["job"] == "early"]
    assert late and min(late) >= 500.0
    assert min(early) < 500.0, "the other job starts at once"
    assert all(r["simulated_time"] > 500.0 for r in metrics if r["job"] == "late")
    # The digits task's worst-class accuracy reaches the run's rows.
    assert all(0.0 <= r["worst_class_accuracy"] <= r["accuracy"] for r in metrics)
    # A real submission of the same file passes over the simulator's key.
    assert [s.job.name for s in load_job_specs(path)] == ["early", "late"]


def test_start_s_must_be_a_number_at_least_zero(tmp_path: Path) -> None:
    body = TWO_JOBS.replace("start_s = 500.0", "start_s = -1.0")
    with pytest.raises(SpecError, match="start_s"):
        load_experiment(experiment_file(tmp_path, body))


def test_noise_options_are_off_by_default_and_off_changes_nothing(tmp_path: Path) -> None:
    assert not Slowdowns.draw(PopulationSection(clients=50), 3).active
    off = [
        "population.profile_noise_sigma=0.0",
        "population.round_noise_sigma=0.0",
        "population.throttle_share=0.0",
    ]
    path = experiment_file(tmp_path)
    # One way of training for both runs: `auto` chooses by a wall-clock probe, and two ways
    # differ in the last float32 digit of a device's loss.
    fixed = ["job.rounds=2", "simulation.trainer=batched"]
    run_experiment(load_experiment(path, fixed), tmp_path / "a", progress=False)
    run_experiment(load_experiment(path, [*fixed, *off]), tmp_path / "b", progress=False)
    assert without_wall(rows(tmp_path / "a")) == without_wall(rows(tmp_path / "b"))
    noisy = ["job.rounds=2", "population.round_noise_sigma=0.5"]
    run_experiment(load_experiment(path, noisy), tmp_path / "c", progress=False)
    times = [r["simulated_time"] for r in rows(tmp_path / "a")]
    assert times != [r["simulated_time"] for r in rows(tmp_path / "c")]


def test_slowdowns_profile_noise_and_throttling() -> None:
    spec = PopulationSection(
        clients=2000,
        profile_noise_sigma=0.5,
        throttle_share=0.25,
        throttle_factor=3.0,
        throttle_after_s=100.0,
    )
    slow = Slowdowns.draw(spec, 7)
    assert slow.active
    logs = [math.log(f) for f in slow.factor]
    assert abs(sum(logs) / len(logs)) < 0.05
    assert 0.4 < (sum(x * x for x in logs) / len(logs)) ** 0.5 < 0.6
    throttling = [i for i, t in enumerate(slow.throttle_at) if math.isfinite(t)]
    assert 0.2 < len(throttling) / 2000 < 0.3
    i = throttling[0]
    onset = slow.throttle_at[i]
    assert slow.compute_factor(i, onset - 1e-6) == pytest.approx(slow.factor[i])
    assert slow.compute_factor(i, onset) == pytest.approx(3.0 * slow.factor[i])
    with pytest.raises(SpecError):
        PopulationSection(throttle_factor=0.5)


@pytest.mark.parametrize(
    "scenario", ["unrelated", "related", "sizes", "noisy", "arrivals", "diurnal"]
)
def test_the_scheduling_scenarios_load(scenario: str) -> None:
    root = Path(__file__).resolve().parents[1]
    experiment = load_experiment(root / "examples" / "scheduling" / f"{scenario}.toml")
    assert experiment.jobs
    if scenario == "arrivals":
        assert len(experiment.jobs) == 8 and experiment.population.clients == 300
        starts = [experiment.start_s(i) for i in range(8)]
        assert starts == sorted(starts) and starts[0] == 0.0 and starts[-1] <= 7200.0


def test_a_population_smaller_than_a_round_is_refused_naming_both_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It used to run to 30 simulated days at 0 %, waiting for devices that do not exist."""
    path = experiment_file(tmp_path)  # 10 clients a round
    with pytest.raises(SpecError, match=r"clients \(9.*job.clients_per_round \(10\)"):
        load_experiment(path, clients=9)
    assert load_experiment(path, clients=10).population.clients == 10
    from flotilla.cli import main

    assert main(["simulate", str(path), "--clients", "5", "--out", str(tmp_path / "out")]) != 0
    assert "population.clients (5, --clients) is below" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_no_plots_draws_no_charts_and_keeps_everything_else(tmp_path: Path) -> None:
    from flotilla.cli import main

    path = experiment_file(tmp_path)
    out = tmp_path / "out"
    args = ["simulate", str(path), "--set", "job.rounds=1", "--no-progress", "--out", str(out)]
    assert main([*args, "--no-plots"]) == 0
    assert not list(out.glob("*.png"))
    assert [r["round"] for r in rows(out)] == [1]
    assert (out / "summary.json").is_file() and (out / "models" / "small.safetensors").is_file()
    assert main(args) == 0  # by default the charts are drawn
    assert (out / "accuracy_vs_time.png").stat().st_size > 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_simulation_leaves_no_scratch_directory(tmp_path: Path, sig: int) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    cmd = [sys.executable, "-m", "flotilla", "simulate", str(experiment_file(tmp_path)),
           "--out", str(tmp_path / "out"), "--no-progress",
           "--set", "job.rounds=100000"]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(scratch)}
    proc = subprocess.Popen(bound(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        metrics = tmp_path / "out" / "metrics.jsonl"
        while not metrics.is_file() or metrics.stat().st_size == 0:  # a round has ended
            assert proc.poll() is None and time.monotonic() < deadline, "no round in 120 s"
            time.sleep(0.1)
        assert list(scratch.glob("flotilla-sim-*")), "the run keeps its scratch in TMPDIR"
        proc.send_signal(sig)
        proc.wait(60)
    finally:
        proc.kill()
        proc.wait(10)
    assert proc.returncode == 130, proc.communicate(timeout=10)
    assert not list(scratch.glob("flotilla-sim-*"))


# --- a researcher's own task and what a run reports -----------------------------------------


def test_server_evaluation_can_be_off_or_sparse_and_devices_numbers_always_reach_the_rows(
    tmp_path: Path,
) -> None:
    from flotilla.cli import main

    path = experiment_file(tmp_path)
    base = ["simulate", str(path), "--no-progress", "--no-plots", "--set", "job.rounds=3"]
    assert main([*base, "--out", str(tmp_path / "on")]) == 0
    assert main([*base, "--out", str(tmp_path / "off"), "--set", "evaluation.server=false"]) == 0
    assert main([*base, "--out", str(tmp_path / "odd"), "--set", "evaluation.every=2"]) == 0
    devices = ("train_loss", "train_accuracy", "client_accuracy", "client_loss")
    for run in ("on", "off", "odd"):
        for row in rows(tmp_path / run):
            assert all(math.isfinite(row[k]) for k in devices), (run, row)
            assert row["train_loss"] > 0
    on, off, odd = (rows(tmp_path / run) for run in ("on", "off", "odd"))
    # On: the held-out split scores each model, which the devices' numbers are not.
    assert all("worst_class_accuracy" in r and r["accuracy"] != r["client_accuracy"] for r in on)
    # Off: the round's accuracy and loss are the devices' own, and nothing else scores it.
    assert all(r["accuracy"] == r["client_accuracy"] for r in off)
    assert all(r["loss"] == r["client_loss"] and "worst_class_accuracy" not in r for r in off)
    # Every 2 rounds (and the last): the same models, scored on rounds 2 and 3 only.
    assert ["accuracy" in r for r in odd] == [False, True, True]
    assert [r["accuracy"] for r in odd[1:]] == [r["accuracy"] for r in on[1:]]
    with pytest.raises(SpecError, match=r"evaluation\.every"):
        load_experiment(path, ["evaluation.every=0"])


TASK_BESIDE_THE_FILE = """
from flotilla.tasks.digits import DigitsTask


class SmallDigits(DigitsTask):
    hidden = (32,)
"""


@pytest.mark.parametrize("devices", ["cpu", "cpu,cpu"])
def test_a_task_beside_the_experiment_file_imports_without_pythonpath(
    tmp_path: Path, devices: str
) -> None:
    """Wherever the command runs from, and in worker processes too (``cpu,cpu``)."""
    project = tmp_path / "study"
    project.mkdir()
    (project / "my_digits.py").write_text(TASK_BESIDE_THE_FILE)
    path = experiment_file(project)
    text = path.read_text().replace("[job]\n", '[job]\ntask = "my_digits:SmallDigits"\n', 1)
    path.write_text(text)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [sys.executable, "-m", "flotilla", "simulate", str(path), "--out", str(elsewhere / "o"),
           "--no-progress", "--no-plots", "--set", "job.rounds=1",
           "--devices", devices]  # fmt: skip
    done = subprocess.run(bound(cmd), cwd=elsewhere, env=env, capture_output=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["round"] for r in rows(elsewhere / "o")] == [1]
    from flotilla.tasks import importable_from

    with importable_from([project]):
        assert sys.path[0] == str(project)
    assert str(project) not in sys.path, "the import path is restored after a run"


def test_the_own_task_example_of_the_docs_runs_from_any_directory(tmp_path: Path) -> None:
    """docs/simulation.md#bring-your-own-task: Flower's workload beside its experiment."""
    example = Path(__file__).resolve().parents[1] / "examples" / "own_task" / "flower-mlp.toml"
    cmd = [sys.executable, "-m", "flotilla", "simulate", str(example), "--out", "o",
           "--no-progress", "--no-plots", "--clients", "40",
           "--set", "job.rounds=2", "--set", "job.clients_per_round=40",
           "--set", "job.min_quorum=40"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(bound(cmd), cwd=tmp_path, env=env, capture_output=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    got = rows(tmp_path / "o")
    assert [(r["round"], r["updates"]) for r in got] == [(1, 40.0), (2, 40.0)]
    assert all(r["train_loss"] > 0 and "client_accuracy" not in r for r in got)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trainer", ["loop", "auto"])
def test_a_task_that_fails_to_train_stops_the_run_with_its_error(
    tmp_path: Path, trainer: str
) -> None:
    """Not a round retried until the time limit: clients train in the event loop's
    callbacks, whose exceptions asyncio would only log."""
    overrides = ["job.task=tests.support.broken_task:BrokenDigits", f"simulation.trainer={trainer}"]
    experiment = load_experiment(experiment_file(tmp_path), overrides)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="this task cannot train"):
        run_experiment(experiment, tmp_path / "out", progress=False, plots=False)
    assert time.monotonic() - started < 60
