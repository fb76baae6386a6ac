"""The cross-job tuner: greedy+ until evidence says otherwise, evidence pooled across jobs,
kept with the jobs' committed state."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from flotilla.core.device import DeviceProfile
from flotilla.core.errors import SpecError
from flotilla.core.spec import SchedulingSection
from flotilla.scheduling import CostModel, DevicePool, DurationModel, RoundOutcome, make_selector
from flotilla.scheduling.history import FleetHistory, KnobTrial
from flotilla.scheduling.tuned import CONTEXT, TunedParams, TunedSelector

TASK = "t"


def devices(n: int = 120, seed: int = 0) -> list[DeviceProfile]:
    rng = np.random.default_rng(seed)
    return [
        DeviceProfile(
            f"d{i:03d}",
            tasks=(TASK,),
            gflops=float(rng.lognormal(3.0, 0.8)),
            upload_bytes_per_s=float(rng.lognormal(14.0, 1.0)),
            samples={TASK: int(rng.integers(10, 500))},
        )
        for i in range(n)
    ]


def tuner(pool: DevicePool, seed: int = 0, **params: object) -> TunedSelector:
    model = DurationModel(pool.history, pool.profile, default_s=15.0, task=TASK)
    return TunedSelector(model, CostModel(1.0, 3000.0), random.Random(seed), TunedParams(**params))  # type: ignore[arg-type]


def pool_of(fleet: list[DeviceProfile], history: FleetHistory | None = None) -> DevicePool:
    pool = DevicePool(lambda: 0.0, history=history or FleetHistory())
    for d in fleet:
        pool.seen(d)
    return pool


CONTEXT_A = (1.0, 0.9, 1.0)  # compute-bound, spread data
CONTEXT_B = (1.0, 0.1, 0.0)  # transfer-bound, equal data


def trials(
    knobs: tuple[float, float], context: tuple[float, ...], reward: float, n: int
) -> list[KnobTrial]:
    return [KnobTrial(r, knobs, context, reward) for r in range(1, n + 1)]


def test_with_no_evidence_it_is_greedy_plus() -> None:
    selector = tuner(pool_of(devices()))
    default = selector.params.arms().index((0.5, 1.0))
    draws = Counter(selector.draw(CONTEXT_A) for _ in range(300))
    assert draws.most_common(1)[0][0] == default
    assert draws[default] > 0.6 * 300


def test_evidence_from_one_job_steers_another_job_of_the_same_kind() -> None:
    history = FleetHistory()
    arms = TunedParams().arms()
    # Job 1 (compute-bound, spread data) learned that rate 1.0 without loss pays and the
    # default does not; job 2 is of the same kind, job 3 of another.
    for t in trials((1.0, 0.0), CONTEXT_A, 1.5, 30) + trials((0.5, 1.0), CONTEXT_A, -0.5, 30):
        history.add_trial("job-1", t)
    selector = tuner(pool_of(devices(), history), seed=1)
    same = Counter(selector.draw(CONTEXT_A) for _ in range(300))
    assert same.most_common(1)[0][0] == arms.index((1.0, 0.0))
    other = Counter(selector.draw(CONTEXT_B) for _ in range(300))
    assert other[arms.index((1.0, 0.0))] < same[arms.index((1.0, 0.0))]


def test_a_rounds_reward_is_its_progress_per_second_against_the_usual() -> None:
    fleet = devices()
    pool = pool_of(fleet)
    selector = tuner(pool)
    loss = 3.0
    plan = [(0.3, 10.0), (0.3, 10.0), (0.3, 10.0), (0.9, 10.0), (0.3, 30.0)]
    for round_no, (drop, seconds) in enumerate(plan, start=1):
        picked = selector.select("job-1", fleet, 10)
        outcome = RoundOutcome(
            "job-1",
            round_no,
            dict.fromkeys(picked, seconds),
            (),
            selected=tuple(picked),
            losses=dict.fromkeys(picked, loss),
            samples=dict.fromkeys(picked, 50),
        )
        pool.record(outcome)
        selector.observe(outcome)
        loss -= drop
    rewards = [t.reward for t in pool.history.trials["job-1"]]
    # Round 1 sets the scale; rounds 2 and 3 as usual (0); round 4 made 3x the progress in
    # the same time; round 5 the usual drop in 3x the time is not known yet (round 6 tells).
    assert len(rewards) == 3
    assert rewards[0] == pytest.approx(0.0, abs=1e-9) and rewards[1] == pytest.approx(0.0, abs=1e-9)
    assert rewards[2] > 1.0
    assert all(len(t.context) == len(CONTEXT) for t in pool.history.trials["job-1"])


def test_trials_and_pending_rounds_survive_a_restart() -> None:
    fleet = devices()
    pool = pool_of(fleet)
    selector = tuner(pool)
    loss = 3.0
    for round_no in range(1, 6):
        picked = selector.select("job-1", fleet, 10)
        outcome = RoundOutcome(
            "job-1", round_no, dict.fromkeys(picked, 10.0), (), selected=tuple(picked),
            losses=dict.fromkeys(picked, loss), samples=dict.fromkeys(picked, 50),
        )  # fmt: skip
        pool.record(outcome)
        selector.observe(outcome)
        loss *= 0.8
    saved_history, saved_selector = pool.history.job_state("job-1"), selector.state()
    fresh = pool_of(fleet)
    fresh.history.restore_job("job-1", saved_history)
    again = tuner(fresh)
    again.restore(saved_selector)
    assert fresh.history.trials == pool.history.trials and len(fresh.history.trials["job-1"]) == 3
    assert again.state() == selector.state()
    # A finished job's lesson alone (no device records) also comes back.
    lesson = pool_of(fleet)
    lesson.history.restore_trials("job-1", saved_history)
    assert lesson.history.all_trials() == pool.history.all_trials()


def test_tuned_is_a_selector_by_name_with_checked_params() -> None:
    pool = pool_of(devices())
    section = SchedulingSection(selector="tuned", params={"rates": [0.0, 1.0]})
    selector = make_selector(section, pool, random.Random(0), deadline_s=60.0, task=TASK)
    assert isinstance(selector, TunedSelector)
    assert len(selector.select("job-1", devices(), 12)) == 12
    with pytest.raises(SpecError, match="rates"):
        make_selector(
            SchedulingSection(selector="tuned", params={"rates": [-1.0]}),
            pool,
            random.Random(0),
            deadline_s=60.0,
        )


# --- on a real federation ------------------------------------------------------------------


async def test_a_restarted_server_keeps_what_finished_jobs_taught(
    db_url: str, tmp_path: Path, digits_spec: Path
) -> None:
    """A tuned job runs to the end on real agents; a server started afterwards on the same
    database and state directory holds its trials, and a new tuned job runs on them."""
    from tests.support.inproc import in_process_federation

    state = tmp_path / "state"
    async with in_process_federation(state, db_url) as fed:
        await fed.start_agents(4)
        first = await fed.submit(
            digits_spec,
            "job.rounds=6",
            "job.clients_per_round=3",
            "job.min_quorum=2",
            "scheduling.selector=tuned",
        )
        status = await fed.wait_for(first, timeout=300)
        assert status["state"] == "completed", status
        learned = fed.federation.knob_trials()
    assert len(learned) >= 2, "rounds 2.. of six report progress"
    assert {t.knobs for t in learned} <= set(TunedParams().arms())
    async with in_process_federation(state, db_url, restart=True) as again:
        assert again.federation.knob_trials() == learned
        await again.start_agents(3)
        second = await again.submit(
            digits_spec, "job.rounds=3", "job.clients_per_round=2", "scheduling.selector=tuned"
        )
        status = await again.wait_for(second, timeout=300)
        assert status["state"] == "completed", status
        assert len(again.federation.knob_trials()) > len(learned)
