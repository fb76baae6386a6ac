"""Data as information: samples in the time model, greedy+, and shard sizes in simulation."""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from flotilla.core.device import DeviceProfile
from flotilla.core.errors import SpecError
from flotilla.core.spec import SchedulingSection
from flotilla.scheduling import (
    CostModel,
    DevicePool,
    DurationModel,
    GreedyParams,
    GreedySelector,
    RoundOutcome,
    make_selector,
)
from flotilla.scheduling.data_greedy import DataGreedyParams, DataGreedySelector
from flotilla.simulation import load_experiment, run_experiment
from flotilla.tasks.base import Shard
from flotilla.tasks.digits import AugmentParams
from tests.support.experiments import experiment_file

JOB = "job-1"
TASK = "t"
#: Compute seconds x GFLOP/s per sample, and transfer seconds x bytes/s, of the fake job.
WORK_PER_SAMPLE, VOLUME = 8.0, 4e6


def fleet(n: int, seed: int = 0, samples: bool = True) -> list[DeviceProfile]:
    """Lognormal speeds and links; shards of 10..500 samples (log-uniform)."""
    rng = np.random.default_rng(seed)
    return [
        DeviceProfile(
            f"d{i:04d}",
            tasks=(TASK,),
            gflops=float(rng.lognormal(3.0, 0.8)),
            upload_bytes_per_s=float(rng.lognormal(14.0, 1.0)),
            samples={TASK: int(np.exp(rng.uniform(np.log(10), np.log(500))))} if samples else {},
        )
        for i in range(n)
    ]


def compute_s(p: DeviceProfile, samples: int, work: float = WORK_PER_SAMPLE) -> float:
    return work * samples / p.gflops


def true_seconds(p: DeviceProfile, work: float = WORK_PER_SAMPLE) -> float:
    return compute_s(p, p.samples.get(TASK, 50), work) + VOLUME / p.upload_bytes_per_s


def pool_of(devices: list[DeviceProfile]) -> DevicePool:
    pool = DevicePool(lambda: 0.0)
    for d in devices:
        pool.seen(d)
    return pool


def model_of(pool: DevicePool, task: str = TASK) -> DurationModel:
    return DurationModel(pool.history, pool.profile, default_s=15.0, task=task)


def play(
    pool: DevicePool, round_no: int, picked: list[DeviceProfile], work: float = WORK_PER_SAMPLE
) -> None:
    """Every picked device delivers in its true time, having trained on its whole shard."""
    pool.record(
        RoundOutcome(
            JOB,
            round_no,
            {p.device_id: true_seconds(p, work) for p in picked},
            (),
            selected=tuple(p.device_id for p in picked),
            compute_s={p.device_id: compute_s(p, p.samples.get(TASK, 50), work) for p in picked},
            losses={p.device_id: 1.0 for p in picked},
            samples={p.device_id: p.samples.get(TASK, 50) for p in picked},
        )
    )


# --- the time model ------------------------------------------------------------------------


def test_unseen_devices_are_predicted_with_their_reported_samples() -> None:
    devices = fleet(300)
    pool = pool_of(devices)
    play(pool, 1, devices[:40])
    unseen = devices[40:]
    truth = np.log([true_seconds(d) for d in unseen])
    with_data = model_of(pool).predict(JOB, unseen).log_mean
    blind = model_of(pool, task="another task").predict(JOB, unseen).log_mean
    # Shards spread 50x: knowing them makes fresh devices' predictions far better.
    assert np.corrcoef(with_data, truth)[0, 1] > 0.95
    assert np.corrcoef(with_data, truth)[0, 1] > np.corrcoef(blind, truth)[0, 1] + 0.1
    assert np.median(np.abs(with_data - truth)) < 0.1


def test_without_reported_samples_the_time_model_is_as_before() -> None:
    devices = fleet(200, samples=False)
    pool = pool_of(devices)
    play(pool, 1, devices[:30])
    with_task = model_of(pool).predict(JOB, devices)
    without = DurationModel(pool.history, pool.profile, default_s=15.0).predict(JOB, devices)
    assert np.allclose(with_task.log_mean, without.log_mean)
    assert np.allclose(with_task.log_std, without.log_std)


# --- greedy+ -------------------------------------------------------------------------------


def greedy_plus(pool: DevicePool, rate: float, beta: float = 3000.0) -> DataGreedySelector:
    return DataGreedySelector(model_of(pool), CostModel(1.0, beta), DataGreedyParams(rate))


def mean_samples(devices: list[DeviceProfile], ids: list[str]) -> float:
    by_id = {d.device_id: d for d in devices}
    return float(np.mean([by_id[i].samples[TASK] for i in ids]))


@pytest.mark.parametrize("seed", range(3))
def test_at_rate_zero_greedy_plus_is_greedy(seed: int) -> None:
    devices = fleet(600, seed)
    pool = pool_of(devices)
    play(pool, 1, devices[:60])
    model = model_of(pool)
    greedy = GreedySelector(model, CostModel(1.0, 3000.0), GreedyParams())
    candidates = devices[60:]
    choice = greedy_plus(pool, 0.0).choose(JOB, candidates, 26, DataGreedyParams(0.0))
    picked = [candidates[int(i)].device_id for i in choice.picks]
    assert choice.pace_s == choice.greedy_pace_s
    assert sorted(picked) == sorted(greedy.select(JOB, candidates, 26))


def test_when_data_costs_little_time_greedy_plus_takes_much_more_of_it() -> None:
    """A transfer-bound job: a large shard barely slows a device, so greedy's choice of
    the fastest wastes the data that was nearly free."""
    devices = fleet(600, seed=1)
    pool = pool_of(devices)
    play(pool, 1, devices[:60], work=0.05)
    model = model_of(pool)
    candidates = devices[60:]
    g = GreedySelector(model, CostModel(1.0, 3000.0), GreedyParams()).select(JOB, candidates, 26)
    plus = greedy_plus(pool, rate=0.5)
    p = plus.select(JOB, candidates, 26)
    seconds = dict(
        zip(
            [c.device_id for c in candidates], model.predict(JOB, candidates).seconds(), strict=True
        )
    )
    assert len(p) == 26 == len(set(p))
    assert max(seconds[d] for d in p) < 1.5 * max(seconds[d] for d in g)
    assert mean_samples(devices, p) > 1.2 * mean_samples(devices, g)


def test_the_exchange_rate_buys_data_with_time_and_stops_at_zero() -> None:
    devices = fleet(600, seed=3)
    pool = pool_of(devices)
    play(pool, 1, devices[:60])
    candidates = devices[60:]
    choices = [
        greedy_plus(pool, rate).choose(JOB, candidates, 26, DataGreedyParams(rate))
        for rate in (0.0, 1.0, 2.0)
    ]
    paces = [c.pace_s for c in choices]
    data = [mean_samples(devices, [candidates[int(i)].device_id for i in c.picks]) for c in choices]
    assert choices[0].pace_s == choices[0].greedy_pace_s
    assert paces == sorted(paces) and paces[2] > paces[0]
    assert data == sorted(data) and data[2] > data[0]


def test_greedy_plus_serves_the_least_picked_first() -> None:
    devices = fleet(200, seed=5)
    pool = pool_of(devices)
    plus = greedy_plus(pool, rate=0.5)
    seen: set[str] = set()
    for r in range(1, 6):
        picked = plus.select(JOB, devices, 30)
        assert not seen & set(picked), f"round {r} picked a device again before all had a turn"
        seen |= set(picked)
        play(pool, r, [d for d in devices if d.device_id in set(picked)])


def test_fairness_as_a_budget_lets_fast_devices_repeat_until_others_are_owed() -> None:
    """Within its budget a device costs nothing for having served, so the round keeps its
    pace with devices already picked; a device owed more than the budget is served
    before any device that is not owed; and no device falls far behind its share."""
    devices = fleet(200, seed=6)
    pool = pool_of(devices)
    budget = DataGreedySelector(
        model_of(pool), CostModel(1.0, 3000.0), DataGreedyParams(fairness="budget", budget=2.0)
    )
    variance = greedy_plus(pool, rate=0.5)
    by_id = {d.device_id: d for d in devices}
    play(pool, 0, devices)  # every device measured once: the time model is exact
    first = budget.select(JOB, devices, 20)
    play(pool, 1, [by_id[d] for d in first])
    # Nobody is owed yet (0.1 selections behind the average): the same fast set is the best again,
    # while greedy's variance sends the round to devices not yet picked.
    assert set(budget.select(JOB, devices, 20)) == set(first)
    assert not set(variance.select(JOB, devices, 20)) & set(first)
    for r in range(2, 61):
        play(pool, r, [by_id[d] for d in budget.select(JOB, devices, 20)])
    rounds = 61  # round 0 took every device
    # A device owed o selections pulls like 2 * beta * o / n seconds of pace, so none
    # falls further behind its share than its extra time says (plus the budget).
    counts = pool.history.selection_counts(JOB, [d.device_id for d in devices])
    seconds = np.array([true_seconds(d) for d in devices])
    extra = 1.5 * (seconds - np.sort(seconds)[19]) * 200 / (2 * 3000.0)
    behind = counts.mean() - counts
    assert np.all(behind <= 2.0 + np.maximum(extra, 0.0) + 1.0), (behind.max(), extra.max())
    assert counts.min() >= 2 and counts.max() < rounds


def test_greedy_plus_weighs_loss_when_asked() -> None:
    devices = [
        DeviceProfile(
            f"d{i}", tasks=(TASK,), gflops=10.0, upload_bytes_per_s=1e6, samples={TASK: 50}
        )
        for i in range(40)
    ]
    pool = pool_of(devices)
    outcome = RoundOutcome(
        JOB,
        1,
        {d.device_id: 5.0 for d in devices},
        (),
        selected=tuple(d.device_id for d in devices),
        losses={d.device_id: 3.0 if i < 10 else 0.5 for i, d in enumerate(devices)},
        samples={d.device_id: 50 for d in devices},
    )
    pool.record(outcome)
    picked = greedy_plus(pool, rate=0.5).select(JOB, devices, 10)
    assert sorted(picked) == sorted(d.device_id for d in devices[:10])
    flat = DataGreedySelector(
        model_of(pool), CostModel(1.0, 3000.0), DataGreedyParams(loss_weight=0.0)
    )
    assert len(flat.select(JOB, devices, 10)) == 10


def test_greedy_plus_is_a_selector_by_name_with_checked_params() -> None:
    pool = pool_of(fleet(50))
    section = SchedulingSection(selector="greedy+", params={"data_rate": 1.0})
    selector = make_selector(section, pool, random.Random(0), deadline_s=60.0, task=TASK)
    assert isinstance(selector, DataGreedySelector) and selector.params.data_rate == 1.0
    with pytest.raises(SpecError, match="data_rat"):
        make_selector(
            SchedulingSection(selector="greedy+", params={"data_rat": 1.0}),
            pool,
            random.Random(0),
            deadline_s=60.0,
        )


# --- shard sizes in the digits task and in simulation --------------------------------------


def test_digits_shard_sizes_spread_log_uniformly_and_follow_the_skew() -> None:
    def sizes(**params: object) -> np.ndarray:
        p = AugmentParams.from_params({"augment": True, **params})
        return np.array(
            [p.shard_size(Shard(i, 2000), np.random.default_rng(i)) for i in range(2000)]
        )

    default = sizes()
    assert default.min() >= 20 and default.max() <= 100
    assert default.tolist() == [
        int(np.random.default_rng(i).integers(20, 101)) for i in range(2000)
    ], "the default draw must not change (earlier studies replay it)"
    spread = sizes(min_samples=10, max_samples=500, size_dist="loguniform")
    assert spread.min() >= 10 and spread.max() <= 500
    assert np.median(spread) < 0.5 * spread.mean() + 40  # most shards small, a few large
    index = np.arange(2000)
    for skew in (-0.3, 0.6):
        skewed = sizes(min_samples=10, max_samples=500, size_dist="loguniform", size_skew=skew)
        assert np.corrcoef(np.log(skewed), index)[0, 1] == pytest.approx(skew, abs=0.08)
    with pytest.raises(ValueError, match="size_dist"):
        AugmentParams.from_params({"size_dist": "normal"})
    with pytest.raises(ValueError, match="size_skew"):
        AugmentParams.from_params({"size_skew": 1.5})


def test_in_simulation_greedy_plus_aggregates_more_data_than_greedy(tmp_path: Path) -> None:
    """Simulated devices report their shard sizes like real ones; greedy+ uses them (at a
    rate that values data above time, since on this compute-bound fleet more data costs
    proportionally more time)."""
    path = experiment_file(tmp_path)
    samples: dict[str, list[float]] = {}
    for selector in ("greedy", "greedy+"):
        overrides = [
            f"scheduling.selector={selector}",
            *(["scheduling.params.data_rate=2.0"] if selector == "greedy+" else []),
            "job.rounds=3",
            "job.clients_per_round=8",
            "job.min_quorum=8",
            "population.clients=120",
            "population.dropout=0.0",
            "population.seconds_per_sample=0.05",
            "data.params.min_samples=10",
            "data.params.max_samples=300",
            "data.params.size_dist=loguniform",
        ]
        out = tmp_path / selector
        run_experiment(load_experiment(path, overrides), out, progress=False)
        per_round: dict[int, list[float]] = defaultdict(list)
        for line in (out / "participation.jsonl").read_text().splitlines():
            row = json.loads(line)
            per_round[row["round"]].append(row["num_samples"])
        samples[selector] = [float(np.sum(v)) for _, v in sorted(per_round.items())]
    assert len(samples["greedy+"]) == 3
    assert np.mean(samples["greedy+"]) > 1.3 * np.mean(samples["greedy"])


SKEWED = {"min_samples": 10, "max_samples": 500, "size_dist": "loguniform", "size_skew": -0.3}


@pytest.mark.parametrize(
    ("params", "count"),
    [({"augment": True}, 100), ({"augment": True, **SKEWED}, 100), ({}, 20)],
)
def test_the_digits_task_counts_a_shard_without_building_it(
    params: dict[str, object], count: int
) -> None:
    from flotilla.core.spec import DataSection
    from flotilla.tasks.digits import DigitsTask

    task, data = DigitsTask(), DataSection(params=params)
    for index in range(0, count, 3):
        shard = Shard(index, count)
        assert task.train_samples(shard, data) == task.load_shard(shard, data).num_train
