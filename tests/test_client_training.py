"""The agent's local training step: global model bytes in, a checked delta out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flotilla.client import LocalTrainer, TrainWork
from flotilla.core.errors import TaskLoadError
from flotilla.core.round_config import RoundConfig
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import decode_state, encode_state, state_spec
from flotilla.tasks import DigitsTask, Shard, ShardTraining, model_state

DIGITS = "flotilla.tasks.digits:DigitsTask"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits.toml"


def work_order(spec: JobSpec, seed: int = 1) -> TrainWork:
    config = {"train": spec.to_dict()["train"], "data": spec.to_dict()["data"]}
    return TrainWork("j", seed, RoundConfig.from_json(json.dumps(config)))


def test_delta_moves_the_model_and_matches_its_layout() -> None:
    task = DigitsTask()
    global_state = model_state(task.build_model(0))
    trainer = LocalTrainer(ShardTraining(DIGITS, Shard(0, 5)))
    outcome = trainer.train(encode_state(global_state), work_order(JobSpec()))
    delta = decode_state(outcome.payload, expected=state_spec(global_state))
    assert outcome.num_samples > 0
    assert {"train_loss", "accuracy", "loss"} <= set(outcome.metrics)
    assert any(np.abs(v).max() > 0 for v in delta.values())
    again = LocalTrainer(ShardTraining(DIGITS, Shard(0, 5))).train(
        encode_state(global_state), work_order(JobSpec())
    )
    assert again.payload == outcome.payload, "same model, shard and seed give the same update"


def test_data_flag_trains_on_a_local_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "mine.npz"
    np.savez(path, x=rng.random((40, 64), dtype=np.float32), y=rng.integers(0, 10, 40))
    global_state = model_state(DigitsTask().build_model(0))
    trainer = LocalTrainer(ShardTraining(DIGITS, Shard(0, 1), data_path=path))
    outcome = trainer.train(encode_state(global_state), work_order(JobSpec()))
    assert outcome.num_samples == 36  # 10% held back for local evaluation

    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros((4, 3)), y=np.zeros(4))
    with pytest.raises(ValueError, match=r"\(N, 64\)"):
        LocalTrainer(ShardTraining(DIGITS, Shard(0, 1), data_path=bad)).train(
            encode_state(global_state), work_order(JobSpec())
        )


def test_data_flag_on_a_task_without_files_is_refused(tmp_path: Path) -> None:
    trainer = LocalTrainer(
        ShardTraining("flotilla.tasks.synthetic:Linear100K", Shard(0, 1), tmp_path / "x.npz")
    )
    from flotilla.tasks import load_task
    from flotilla.tasks import model_state as state_of

    task = load_task("flotilla.tasks.synthetic:Linear100K")
    if hasattr(task, "load_path"):
        pytest.fail("the synthetic task unexpectedly reads files; pick another task for this test")
    state = state_of(task.build_model(0))
    with pytest.raises(TaskLoadError, match="does not read local files"):
        trainer.train(encode_state(state), work_order(JobSpec()))


def plan_order(spec: JobSpec, job_id: str = "j", seed: int = 1) -> TrainWork:
    """A work order exactly as the engine writes it for ``spec``."""
    from flotilla.engine import JobPlan

    plan = JobPlan.from_spec(spec)
    layout = state_spec(model_state(DigitsTask().build_model(0)))
    config = plan.client_config_json(layout, {})
    return TrainWork(job_id, seed, RoundConfig.from_json(config))


def test_the_uplink_codec_shrinks_the_update_and_the_server_decodes_it() -> None:
    from flotilla.compression import make_codec
    from flotilla.server.federation.uploads import decode_update

    global_state = model_state(DigitsTask().build_model(0))
    layout = state_spec(global_state)
    plain = LocalTrainer(ShardTraining(DIGITS, Shard(0, 5))).train(
        encode_state(global_state), plan_order(JobSpec())
    )
    spec = JobSpec.load(EXAMPLE, ["compression.uplink=int8"])
    small = LocalTrainer(ShardTraining(DIGITS, Shard(0, 5))).train(
        encode_state(global_state), plan_order(spec)
    )
    assert small.codec == "int8"
    assert len(plain.payload) / len(small.payload) > 3.5
    exact = decode_state(plain.payload, expected=layout)
    got = decode_update(memoryview(small.payload), layout, make_codec("int8"), 1 << 24)
    for name, value in exact.items():
        block_max = np.abs(value).max()
        assert np.abs(got[name] - value).max() <= block_max / 127 + 1e-7


def test_error_feedback_residuals_survive_an_agent_restart(tmp_path: Path) -> None:
    global_state = encode_state(model_state(DigitsTask().build_model(0)))
    spec = JobSpec.load(
        EXAMPLE,
        ["compression.uplink=topk", "compression.uplink_params.fraction=0.01",
         "compression.error_feedback=true"],
    )  # fmt: skip
    LocalTrainer(ShardTraining(DIGITS, Shard(0, 5)), state_dir=tmp_path).train(
        global_state, plan_order(spec)
    )
    files = list(tmp_path.glob("ef-*.safetensors"))
    assert len(files) == 1, "the residual is saved in the agent's state dir"
    saved = decode_state(files[0].read_bytes())
    assert sum(float(np.abs(v).sum()) for v in saved.values()) > 0, "top-1% leaves a residual"

    # A new agent process (new trainer) picks the residual up: its update differs from one
    # made without it.
    resumed = LocalTrainer(ShardTraining(DIGITS, Shard(0, 5)), state_dir=tmp_path).train(
        global_state, plan_order(spec)
    )
    fresh = LocalTrainer(ShardTraining(DIGITS, Shard(0, 5)), state_dir=tmp_path / "other").train(
        global_state, plan_order(spec)
    )
    assert resumed.payload != fresh.payload


def test_update_momentum_smooths_deltas_across_rounds(tmp_path: Path) -> None:
    global_state = model_state(DigitsTask().build_model(0))
    layout = state_spec(global_state)
    spec = JobSpec.load(EXAMPLE, ["train.update_momentum=0.5"])
    trainer = LocalTrainer(ShardTraining(DIGITS, Shard(0, 5)), state_dir=tmp_path)
    first = decode_state(trainer.train(encode_state(global_state), plan_order(spec)).payload)
    raw = decode_state(
        LocalTrainer(ShardTraining(DIGITS, Shard(0, 5)))
        .train(encode_state(global_state), plan_order(JobSpec()))
        .payload,
        expected=layout,
    )
    for name in raw:
        np.testing.assert_allclose(first[name], 0.5 * raw[name], rtol=1e-5, atol=1e-7)
    second = decode_state(trainer.train(encode_state(global_state), plan_order(spec)).payload)
    for name in raw:  # m2 = 0.5 * m1 + 0.5 * raw = 0.75 * raw (same model, same seed)
        np.testing.assert_allclose(second[name], 0.75 * raw[name], rtol=1e-5, atol=1e-7)


def test_fedprox_term_keeps_local_weights_near_the_global_model() -> None:
    global_state = encode_state(model_state(DigitsTask().build_model(0)))

    def drift(mu: float) -> float:
        spec = JobSpec.load(EXAMPLE, [f"train.proximal_mu={mu}", "train.local_epochs=3"])
        delta = decode_state(
            LocalTrainer(ShardTraining(DIGITS, Shard(0, 5)))
            .train(global_state, plan_order(spec))
            .payload
        )
        return float(np.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in delta.values())))

    assert drift(10.0) < 0.5 * drift(0.0)
