"""The agent's local training step: global model bytes in, a checked delta out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flotilla.client import LocalTrainer
from flotilla.core.errors import TaskLoadError
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import decode_state, encode_state, state_spec
from flotilla.proto import flotilla_pb2 as pb
from flotilla.tasks import DigitsTask, Shard, model_state

DIGITS = "flotilla.tasks.digits:DigitsTask"


def work_order(spec: JobSpec, seed: int = 1) -> pb.TrainTask:
    config = {"train": spec.to_dict()["train"], "data": spec.to_dict()["data"]}
    return pb.TrainTask(
        job_id="j", round=1, round_token="t", config_json=json.dumps(config), seed=seed
    )


def test_delta_moves_the_model_and_matches_its_layout() -> None:
    task = DigitsTask()
    global_state = model_state(task.build_model(0))
    trainer = LocalTrainer(DIGITS, Shard(0, 5))
    outcome = trainer.train(encode_state(global_state), work_order(JobSpec()))
    delta = decode_state(outcome.payload, expected=state_spec(global_state))
    assert outcome.num_samples > 0
    assert {"train_loss", "accuracy", "loss"} <= set(outcome.metrics)
    assert any(np.abs(v).max() > 0 for v in delta.values())
    again = LocalTrainer(DIGITS, Shard(0, 5)).train(
        encode_state(global_state), work_order(JobSpec())
    )
    assert again.payload == outcome.payload, "same model, shard and seed give the same update"


def test_data_flag_trains_on_a_local_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "mine.npz"
    np.savez(path, x=rng.random((40, 64), dtype=np.float32), y=rng.integers(0, 10, 40))
    global_state = model_state(DigitsTask().build_model(0))
    trainer = LocalTrainer(DIGITS, Shard(0, 1), data_path=path)
    outcome = trainer.train(encode_state(global_state), work_order(JobSpec()))
    assert outcome.num_samples == 36  # 10% held back for local evaluation

    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros((4, 3)), y=np.zeros(4))
    with pytest.raises(ValueError, match=r"\(N, 64\)"):
        LocalTrainer(DIGITS, Shard(0, 1), data_path=bad).train(
            encode_state(global_state), work_order(JobSpec())
        )


def test_data_flag_on_a_task_without_files_is_refused(tmp_path: Path) -> None:
    trainer = LocalTrainer(
        "flotilla.tasks.synthetic:Linear100K", Shard(0, 1), data_path=tmp_path / "x.npz"
    )
    from flotilla.tasks import load_task
    from flotilla.tasks import model_state as state_of

    task = load_task("flotilla.tasks.synthetic:Linear100K")
    if hasattr(task, "load_path"):
        pytest.fail("the synthetic task unexpectedly reads files; pick another task for this test")
    state = state_of(task.build_model(0))
    with pytest.raises(TaskLoadError, match="does not read local files"):
        trainer.train(encode_state(state), work_order(JobSpec()))
