"""The torch-free trainer: a round in NumPy gives what the torch digits task and the gRPC
agent's trainer give, to 1e-5, on the same shard and seed (the batch order is torch's
``randperm``, rebuilt from the seed, not injected); and it refuses what it cannot do."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from flotilla.client import LocalTrainer, TrainWork
from flotilla.compression import FileStates
from flotilla.core.errors import SpecError, TaskLoadError, WireError
from flotilla.core.round_config import RoundConfig
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import decode_state, encode_state, state_spec
from flotilla.core.work import WorkOrder
from flotilla.mobile.lite import DigitsModel, LiteTrainer, ShardFile, ShardInfo, Stopped
from flotilla.mobile.lite.mlp import batch_orders
from flotilla.tasks import DigitsTask, Shard, ShardTraining, model_state
from flotilla.tasks.digits import WideDigitsTask

DIGITS = "flotilla.tasks.digits:DigitsTask"
SHARD = Shard(1, 4)
TOL = 1e-5


@pytest.fixture(scope="module")
def task() -> DigitsTask:
    return DigitsTask()


def shard_file(task: DigitsTask, spec: JobSpec) -> ShardFile:
    local = task.load_shard(SHARD, spec.data)
    info = ShardInfo(DIGITS, SHARD.index, SHARD.count, spec.data.alpha, spec.data.seed, {})
    arrays = [t.numpy() for t in (*local.train, *local.val)]
    return ShardFile(*arrays, info=info)


def order(spec: JobSpec, seed: int, round_no: int = 1, **extra: Any) -> WorkOrder:
    full = spec.to_dict()
    config = {k: full[k] for k in ("train", "data", "compression")} | extra
    return WorkOrder("job-1", round_no, f"tok{round_no}", DIGITS, json.dumps(config), "", 0,
                     0.0, seed)  # fmt: skip


def spec_with(**train: Any) -> JobSpec:
    return JobSpec.from_dict({"train": train, "data": {"alpha": 0.5, "seed": 3}})


@pytest.mark.parametrize("n", [0, 1, 2, 37, 1000])
def test_batch_order_is_torchs_randperm_for_any_seed(n: int) -> None:
    for seed in (0, 12345, 2**31 + 5, 2**62 + 11):
        gen = torch.Generator().manual_seed(seed)
        expected = [torch.randperm(n, generator=gen).numpy() for _ in range(3)]
        got = list(batch_orders(n, seed, 3))
        assert all(np.array_equal(a, b) for a, b in zip(expected, got, strict=True)), seed


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "train",
    [
        {},  # the defaults: 1 epoch, batch 32, lr 0.05, momentum 0.9
        {"local_epochs": 2, "batch_size": 16, "learning_rate": 0.1, "momentum": 0.5,
         "weight_decay": 1e-3, "proximal_mu": 0.1},
        {"momentum": 0.0, "update_momentum": 0.5},
    ],
    ids=["defaults", "fedprox-decay-epochs", "update-momentum"],
)  # fmt: skip
def test_two_rounds_match_the_torch_agents_update(task: DigitsTask, train: dict[str, Any]) -> None:
    """Plain uploads, decoded: the lite delta is the torch agent's, and so are the metrics,
    over two rounds (update momentum carries from one to the next)."""
    spec = spec_with(**train)
    lite = LiteTrainer(shard_file(task, spec))
    agent = LocalTrainer(ShardTraining(DIGITS, SHARD, task=task))
    model = encode_state(model_state(task.build_model(7)))
    layout = state_spec(decode_state(model))
    for round_no, seed in ((1, 2024), (2, 99)):
        work = order(spec, seed, round_no)
        mine = lite.train(work, model)
        assert not isinstance(mine, Stopped)
        theirs = agent.train(
            model, TrainWork("job-1", seed, RoundConfig.from_json(work.config_json))
        )
        got, want = decode_state(mine.payload, layout), decode_state(theirs.payload, layout)
        worst = max(float(np.abs(got[k] - want[k]).max()) for k in want)
        assert worst < TOL, f"round {round_no}: parameters differ by {worst}"
        assert mine.num_samples == theirs.num_samples and mine.codec == "none"
        for name in ("train_loss", "train_accuracy", "accuracy", "loss", "num_samples"):
            assert mine.metrics[name] == pytest.approx(theirs.metrics[name], abs=TOL), name
        model = encode_state({k: decode_state(model)[k] + want[k] for k in want})


def test_layout_is_the_torch_state_dict(task: DigitsTask) -> None:
    assert DigitsModel.for_task(DIGITS).layout() == state_spec(model_state(task.build_model(0)))
    wide = state_spec(model_state(WideDigitsTask().build_model(0)))
    assert DigitsModel.for_task("flotilla.tasks.digits:WideDigitsTask").layout() == wide


def test_what_it_cannot_do_is_named_not_trained(task: DigitsTask) -> None:
    spec = spec_with()
    lite = LiteTrainer(shard_file(task, spec))
    p2p = {
        "initial_peers": ["/ip4/127.0.0.1/tcp/1/p2p/x"],
        "group_size": 2,
        "min_group_size": 2,
        "matchmaking_s": 5.0,
    }
    cases = {
        "train.params": order(spec_with(params={"dropout": 0.1}), 1),
        "cannot encode codec 'topk'": order(
            JobSpec.from_dict({"compression": {"uplink": "topk"}}), 1
        ),
        "cannot encode codec 'qsgd'": dataclasses.replace(order(spec, 1), uplink_codec="qsgd"),
        "server-less (p2p)": order(spec, 1, p2p=p2p),
        "trains only": dataclasses.replace(order(spec, 1), task="flotilla.tasks.charlm:CharLM"),
        "require_charging": order(spec, 1, eligibility={"require_charging": "yes"}),
    }
    model = encode_state(model_state(task.build_model(0)))
    for needle, work in cases.items():
        reason = lite.unsupported(work)
        assert reason is not None and needle in reason, (needle, reason)
        with pytest.raises((SpecError, TaskLoadError, WireError)):
            lite.train(work, model)
    assert lite.unsupported(order(spec, 1)) is None
    int8 = JobSpec.from_dict({"compression": {"uplink": "int8", "error_feedback": True}})
    assert lite.unsupported(order(int8, 1)) is None


def test_a_stop_between_batches_returns_the_reason(task: DigitsTask) -> None:
    spec = spec_with()
    lite = LiteTrainer(shard_file(task, spec))
    model = encode_state(model_state(task.build_model(0)))
    calls: list[int] = []

    def should_stop() -> str | None:
        calls.append(1)
        return "not charging" if len(calls) > 3 else None

    stopped = lite.train(order(spec, 5), model, should_stop)
    assert stopped == Stopped("not charging", steps=3)
    assert lite.train(order(spec, 5), model, lambda: None) != stopped


def test_momentum_state_is_the_agents(task: DigitsTask, tmp_path: Path) -> None:
    """After a round the lite device holds the momentum the agent keeps in its state dir."""
    spec = spec_with(update_momentum=0.9)
    lite = LiteTrainer(shard_file(task, spec))
    agent = LocalTrainer(ShardTraining(DIGITS, SHARD, task=task), state_dir=tmp_path)
    model = encode_state(model_state(task.build_model(1)))
    work = order(spec, 3)
    lite.train(work, model)
    agent.train(model, TrainWork("job-1", 3, RoundConfig.from_json(work.config_json)))
    mine = lite.states.get("momentum", "job-1")
    theirs = FileStates(tmp_path, prefix="momentum:").get("job-1")
    assert mine is not None and theirs is not None
    assert max(float(np.abs(mine[k] - theirs[k]).max()) for k in theirs) < TOL
