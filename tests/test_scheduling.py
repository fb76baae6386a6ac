"""The device pool (who is idle, one job per device) and the random selector."""

from __future__ import annotations

import random

import pytest

from flotilla.core.device import DeviceProfile
from flotilla.scheduling import DevicePool, RandomSelector


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _device(device_id: str, *tasks: str) -> DeviceProfile:
    return DeviceProfile(device_id, tasks=tasks)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pool(clock: FakeClock) -> DevicePool:
    pool = DevicePool(clock)
    for device_id, tasks in [("d3", "AB"), ("d1", "A"), ("d2", "B"), ("d4", "A"), ("d5", "A")]:
        pool.seen(_device(device_id, *tasks))
    return pool


def _idle(pool: DevicePool, task: str) -> list[str]:
    return [p.device_id for p in pool.idle(task)]


def test_idle_filters_by_task_online_and_busy(pool: DevicePool) -> None:
    assert _idle(pool, "A") == ["d1", "d3", "d4", "d5"]
    assert _idle(pool, "B") == ["d2", "d3"]
    assert _idle(pool, "C") == []
    pool.leave("d4")
    pool.claim(["d5"], "job-x")
    assert _idle(pool, "A") == ["d1", "d3"]
    assert len(pool) == 4


def test_claim_is_exclusive_across_jobs(pool: DevicePool) -> None:
    pool.claim(["d1", "d3"], "job-a")
    assert pool.busy_with("d1") == pool.busy_with("d3") == "job-a"
    assert _idle(pool, "A") == ["d4", "d5"]  # job B sees neither
    assert _idle(pool, "B") == ["d2"]
    with pytest.raises(RuntimeError, match="d3 is not idle"):
        pool.claim(["d3"], "job-b")
    with pytest.raises(RuntimeError, match="not idle"):
        pool.claim(["d1"], "job-a")  # not even twice by the same job
    assert pool.busy_with("d3") == "job-a"


def test_claim_is_all_or_nothing(pool: DevicePool) -> None:
    pool.claim(["d1"], "job-a")
    with pytest.raises(RuntimeError):
        pool.claim(["d4", "d5", "d1"], "job-b")
    assert pool.busy_with("d4") is None and pool.busy_with("d5") is None


def test_claiming_an_offline_device_raises(pool: DevicePool) -> None:
    pool.leave("d1")
    with pytest.raises(RuntimeError, match="not idle"):
        pool.claim(["d1"], "job-a")


def test_release_only_by_the_owning_job(pool: DevicePool) -> None:
    pool.claim(["d1"], "job-a")
    pool.release("d1", "job-b")
    assert pool.busy_with("d1") == "job-a"
    pool.release("d1", "job-a")
    assert pool.busy_with("d1") is None
    assert "d1" in _idle(pool, "A")
    pool.release("nobody", "job-a")  # unknown devices are ignored


def test_expire_takes_silent_devices_offline(pool: DevicePool, clock: FakeClock) -> None:
    pool.claim(["d1", "d3"], "job-a")
    clock.now += 20
    pool.touch("d3")
    pool.seen(_device("d4", "A"))
    clock.now += 10
    assert pool.expire(30.0) == []  # exactly 30 s of silence is still alive
    clock.now += 0.5
    assert sorted(pool.expire(30.0)) == ["d1", "d2", "d5"]
    assert not pool.is_online("d1")
    assert pool.busy_with("d1") == "job-a"  # its job holds it until it releases it
    assert pool.busy_with("d3") == "job-a"
    assert _idle(pool, "A") == ["d4"]
    assert len(pool) == 2
    assert pool.expire(30.0) == []  # already offline: not reported twice


def test_a_silent_busy_device_that_speaks_again_is_not_claimed_twice(
    pool: DevicePool, clock: FakeClock
) -> None:
    """Its update may already be queued for its job: a second job must wait for the release."""
    pool.claim(["d1"], "job-a")
    clock.now += 100
    pool.expire(30.0)
    pool.touch("d1")
    assert pool.is_online("d1")
    assert "d1" not in _idle(pool, "A")
    pool.release("d1", "job-a")
    assert "d1" in _idle(pool, "A")


def test_a_device_that_comes_back_is_idle_again(pool: DevicePool, clock: FakeClock) -> None:
    clock.now += 100
    pool.expire(30.0)
    assert _idle(pool, "A") == []
    pool.touch("d1")
    pool.seen(_device("d4", "A", "C"))  # a fresh profile replaces the old one
    assert _idle(pool, "A") == ["d1", "d4"]
    assert _idle(pool, "C") == ["d4"]


def test_unknown_devices_are_neither_online_nor_busy(pool: DevicePool) -> None:
    pool.touch("ghost")
    pool.leave("ghost")
    assert not pool.is_online("ghost")
    assert pool.busy_with("ghost") is None


# --- selector -------------------------------------------------------------------------------


CANDIDATES = [_device(f"dev-{i:02d}", "A") for i in range(40)]


def test_random_selector_is_deterministic_for_a_seed() -> None:
    a, b = RandomSelector(random.Random(7)), RandomSelector(random.Random(7))
    picks_a = [a.select("job", CANDIDATES, 5) for _ in range(5)]
    picks_b = [b.select("job", CANDIDATES, 5) for _ in range(5)]
    assert picks_a == picks_b
    other = RandomSelector(random.Random(8))
    assert [other.select("job", CANDIDATES, 5) for _ in range(5)] != picks_a


@pytest.mark.parametrize("count", [0, 1, 5, 39, 40, 41, 100])
def test_random_selector_picks_distinct_candidates_up_to_count(count: int) -> None:
    selector = RandomSelector(random.Random(count))
    ids = {c.device_id for c in CANDIDATES}
    for _ in range(20):
        chosen = selector.select("job", CANDIDATES, count)
        assert len(chosen) == min(count, len(CANDIDATES))
        assert len(set(chosen)) == len(chosen)
        assert set(chosen) <= ids


def test_random_selector_with_no_candidates() -> None:
    assert RandomSelector(random.Random(0)).select("job", [], 3) == []


def test_random_selector_spreads_over_all_candidates() -> None:
    selector = RandomSelector(random.Random(1))
    seen = {d for _ in range(100) for d in selector.select("job", CANDIDATES, 4)}
    assert len(seen) == len(CANDIDATES)


def test_describe_says_what_each_device_is_doing_and_why_not(pool: DevicePool) -> None:
    pool.claim(["d1"], "job-x")
    pool.leave("d4")
    views = {v.device_id: v for v in pool.describe("B")}
    assert views["d1"].state == "busy" and views["d1"].job_id == "job-x"
    assert views["d4"].state == "offline"
    assert views["d5"].state == "ineligible" and views["d5"].reason == "task B is not installed"
    assert views["d2"].state == views["d3"].state == "idle"
    assert {v.state for v in pool.describe()} == {"busy", "offline", "idle"}
