"""The Task seam and the digits reference task: shards, determinism, state transfer, FedAvg."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support.lifetime import bound

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

from flotilla.core.errors import TaskLoadError  # noqa: E402
from flotilla.core.spec import DataSection, TrainSection  # noqa: E402
from flotilla.tasks import (  # noqa: E402
    DigitsTask,
    LocalData,
    Shard,
    Task,
    load_model_state,
    load_task,
    model_state,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def task() -> DigitsTask:
    return DigitsTask()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models train faster on one thread than with cross-core chatter."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _rows(x: torch.Tensor, y: torch.Tensor) -> Counter[bytes]:
    """A multiset of (image, label) rows, to compare splits without their indices."""
    xs, ys = x.numpy().astype(np.float32), y.numpy().astype(np.int64)
    return Counter(xs[i].tobytes() + ys[i].tobytes() for i in range(len(ys)))


def _labels(local: LocalData) -> np.ndarray:
    return np.concatenate([local.train[1].numpy(), local.val[1].numpy()])


# -- Shard ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "index", "count"), [("0/1", 0, 1), ("3/5", 3, 5), (" 2 / 4 ", 2, 4)]
)
def test_shard_parse_good(text: str, index: int, count: int) -> None:
    shard = Shard.parse(text)
    assert shard == Shard(index, count)
    assert Shard.parse(str(shard)) == shard


@pytest.mark.parametrize("text", ["5/5", "-1/3", "1/0", "a/b", "3", "", "1/2/3", "/4", "1.0/2"])
def test_shard_parse_bad(text: str) -> None:
    with pytest.raises(ValueError, match="i/N"):
        Shard.parse(text)


def test_shard_constructor_checks_range() -> None:
    with pytest.raises(ValueError, match="index"):
        Shard(3, 3)
    with pytest.raises(ValueError, match="count"):
        Shard(0, 0)


# -- load_task ------------------------------------------------------------------------------


def test_load_task_builds_digits() -> None:
    loaded = load_task("flotilla.tasks.digits:DigitsTask")
    assert isinstance(loaded, DigitsTask)
    assert isinstance(loaded, Task)


@pytest.mark.parametrize(
    ("entrypoint", "fragment"),
    [
        ("flotilla.tasks.digits.DigitsTask", "package.module:Name"),
        ("flotilla.tasks.digits:", "package.module:Name"),
        (":DigitsTask", "package.module:Name"),
        ("a:b:c", "package.module:Name"),
        ("flotilla.no_such_module:Task", "cannot import module 'flotilla.no_such_module'"),
        ("flotilla.tasks.digits:NoSuchTask", "no attribute 'NoSuchTask'"),
        ("flotilla.tasks.digits:NUM_CLASSES", "not a class"),
        ("flotilla.core.spec:JobSection", "does not implement the Task protocol"),
    ],
)
def test_load_task_errors(entrypoint: str, fragment: str) -> None:
    with pytest.raises(TaskLoadError) as info:
        load_task(entrypoint)
    assert fragment in str(info.value)


def test_import_is_light() -> None:
    """Torch-free processes import the package; DigitsTask alone pulls in torch."""
    code = (
        "import sys, flotilla.tasks as t\n"
        "assert 'torch' not in sys.modules and 'sklearn' not in sys.modules, 'eager import'\n"
        "t.DigitsTask\n"
        "assert 'torch' in sys.modules\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        bound([sys.executable, "-c", code]),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


# -- data -----------------------------------------------------------------------------------


def test_heldout_is_fixed_and_stratified(task: DigitsTask) -> None:
    x, y = task.heldout()
    x2, y2 = DigitsTask().heldout()
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert x.shape == (len(y), 64) and x.dtype == torch.float32
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    assert 340 <= len(y) <= 380  # ~20% of 1,797
    per_class = np.bincount(y.numpy(), minlength=10)
    assert per_class.min() >= 34 and per_class.max() <= 38


@pytest.mark.parametrize("alpha", [0.1, 0.5, 100.0])
def test_shards_are_disjoint_and_cover_the_pool(task: DigitsTask, alpha: float) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    everything = _rows(
        torch.from_numpy((digits.data / 16.0).astype(np.float32)), torch.from_numpy(digits.target)
    )
    pool = everything - _rows(*task.heldout())
    data = DataSection(alpha=alpha, seed=3)
    union: Counter[bytes] = Counter()
    for i in range(5):
        local = task.load_shard(Shard(i, 5), data)
        n_train, n_val = len(local.train[1]), len(local.val[1])
        assert n_train + n_val >= 10
        assert n_val == max(1, round(0.1 * (n_train + n_val)))
        union += _rows(*local.train) + _rows(*local.val)
    # Equal multisets: nothing lost, nothing duplicated, nothing leaked from held-out.
    assert union == pool
    assert sum(union.values()) == sum(pool.values())


def _mean_skew(task: DigitsTask, alpha: float, seed: int) -> float:
    """Mean total-variation distance between each shard's label mix and the pool's."""
    labels = [_labels(task.load_shard(Shard(i, 5), DataSection(alpha, seed))) for i in range(5)]
    overall = np.bincount(np.concatenate(labels), minlength=10) / sum(map(len, labels))
    return float(
        np.mean(
            [0.5 * np.abs(np.bincount(y, minlength=10) / len(y) - overall).sum() for y in labels]
        )
    )


def test_small_alpha_is_non_iid(task: DigitsTask) -> None:
    for seed in range(3):
        assert _mean_skew(task, 0.1, seed) > 0.4
        assert _mean_skew(task, 100.0, seed) < 0.15


def test_shards_are_deterministic(task: DigitsTask) -> None:
    data = DataSection(alpha=0.5, seed=7)
    a = task.load_shard(Shard(2, 5), data)
    b = DigitsTask().load_shard(Shard(2, 5), data)
    for left, right in [(a.train, b.train), (a.val, b.val)]:
        assert torch.equal(left[0], right[0]) and torch.equal(left[1], right[1])
    c = task.load_shard(Shard(2, 5), DataSection(alpha=0.5, seed=8))
    assert len(c.train[1]) != len(a.train[1]) or not torch.equal(c.train[0], a.train[0])


def test_too_many_shards_is_a_clear_error(task: DigitsTask) -> None:
    with pytest.raises(ValueError, match="cannot fill"):
        task.load_shard(Shard(0, 1000), DataSection())


# -- models and states ----------------------------------------------------------------------


def test_build_model_is_deterministic_and_leaves_global_rng(task: DigitsTask) -> None:
    rng_before = torch.get_rng_state()
    a, b, c = (model_state(task.build_model(seed)) for seed in (1, 1, 2))
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert list(a) == list(b) == list(c)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert any(not np.array_equal(a[k], c[k]) for k in a)


def test_model_state_round_trip(task: DigitsTask) -> None:
    source, target = task.build_model(1), task.build_model(2)
    state = model_state(source)
    assert list(state) == list(source.state_dict())
    for arr in state.values():
        assert arr.dtype == np.float32 and arr.flags.c_contiguous
    # Copies, not views: mutating the array must not touch the model.
    first = next(iter(state))
    state[first][...] = 123.0
    assert not np.array_equal(model_state(source)[first], state[first])

    fresh = model_state(source)
    frozen = {k: v.copy() for k, v in fresh.items()}
    for arr in frozen.values():
        arr.flags.writeable = False  # decoded wire states are read-only views
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_model_state(target, frozen)
    assert all(np.array_equal(model_state(target)[k], fresh[k]) for k in fresh)
    x, _ = task.heldout()
    with torch.no_grad():
        assert torch.equal(source(x), target(x))


def test_load_model_state_is_strict(task: DigitsTask) -> None:
    model = task.build_model(0)
    state = model_state(model)
    first, last = next(iter(state)), list(state)[-1]

    missing = dict(state)
    del missing[last]
    with pytest.raises(ValueError, match=re.escape(last)):
        load_model_state(model, missing)

    extra = {**state, "head.extra": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match=re.escape("head.extra")):
        load_model_state(model, extra)

    reshaped = {**state, first: state[first].reshape(-1)}
    with pytest.raises(ValueError, match=re.escape(first)):
        load_model_state(model, reshaped)
    # A refused state leaves the model untouched.
    assert all(np.array_equal(model_state(model)[k], state[k]) for k in state)


def test_train_and_evaluate(task: DigitsTask, one_thread: None) -> None:
    local = task.load_shard(Shard(0, 2), DataSection(alpha=100.0, seed=0))
    config = TrainSection(local_epochs=3)
    before = task.evaluate(task.build_model(0), local.val)
    assert {"accuracy", "loss"} <= set(before)

    rng_before = torch.get_rng_state()
    runs = []
    for _ in range(2):
        model = task.build_model(0)
        num_samples, metrics = task.train(model, local, config, seed=5)
        runs.append(model_state(model))
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert num_samples == local.num_train
    assert np.isfinite(metrics["train_loss"])
    assert all(np.array_equal(runs[0][k], runs[1][k]) for k in runs[0])

    other = task.build_model(0)
    task.train(other, local, config, seed=6)
    assert any(not np.array_equal(model_state(other)[k], runs[0][k]) for k in runs[0])

    after = task.evaluate(model, task.heldout())
    assert after["accuracy"] > 0.85 > before["accuracy"]
    assert after["loss"] < before["loss"]


# -- federated averaging --------------------------------------------------------------------


def test_fedavg_reaches_target_accuracy(task: DigitsTask, one_thread: None) -> None:
    """What the product promises: 20 non-IID FedAvg rounds with spec defaults reach >= 90%."""
    config, data, rounds = TrainSection(), DataSection(alpha=0.5, seed=0), 20
    shards = [task.load_shard(Shard(i, 5), data) for i in range(5)]
    model = task.build_model(seed=0)
    global_state = model_state(model)
    rng = np.random.default_rng(0)
    heldout = task.heldout()
    initial = task.evaluate(model, heldout)["accuracy"]
    for rnd in range(rounds):
        states, weights = [], []
        for c in rng.choice(5, size=4, replace=False):
            local = task.build_model(seed=0)
            load_model_state(local, global_state)
            num_samples, _ = task.train(local, shards[c], config, seed=rnd * 100 + int(c))
            states.append(model_state(local))
            weights.append(num_samples)
        share = np.asarray(weights, dtype=np.float64) / sum(weights)
        global_state = {
            k: sum(w * s[k] for w, s in zip(share, states, strict=True)).astype(np.float32)
            for k in global_state
        }
    load_model_state(model, global_state)
    accuracy = task.evaluate(model, heldout)["accuracy"]
    print(f"FedAvg held-out accuracy after {rounds} rounds: {accuracy:.4f} (from {initial:.4f})")
    assert accuracy >= 0.90
