"""The lite device's conditions file, state dir and command line: a device that is
unplugged mid-round stops between batches with the reason; a restart keeps its credential
(owner-only), transfers in progress and per-job state; bad arguments exit at once."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import numpy as np
import pytest

from flotilla.core.conditions import DeviceConditions
from flotilla.core.errors import SpecError, WireError
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import encode_state
from flotilla.core.work import DeviceCredential, WorkOrder
from flotilla.mobile.lite import (
    DigitsModel,
    LiteConditions,
    LiteState,
    LiteTrainer,
    ShardFile,
    ShardInfo,
    Stopped,
    job_policy,
    stop_check,
    write_shard,
)
from flotilla.mobile.lite.__main__ import main

DIGITS = "flotilla.tasks.digits:DigitsTask"
SHA = "ab" * 32


def shard(n: int = 200) -> ShardFile:
    rng = np.random.default_rng(0)
    x, y = rng.random((n, 64), dtype=np.float32), rng.integers(0, 10, n)
    return ShardFile(x[10:], y[10:], x[:10], y[:10], ShardInfo(DIGITS, 0, 1, 0.5, 0, {}))


def order(eligibility: dict[str, object] | None) -> WorkOrder:
    full = JobSpec().to_dict()
    config = {k: full[k] for k in ("train", "data", "compression")}
    if eligibility is not None:
        config["eligibility"] = eligibility
    return WorkOrder("job", 1, "t", DIGITS, json.dumps(config), "", 0, 0.0, 1)


def initial_model() -> bytes:
    rng = np.random.default_rng(1)
    return encode_state({s.name: rng.normal(0, 0.1, s.shape).astype(np.float32)
                         for s in DigitsModel.for_task(DIGITS).layout()})  # fmt: skip


def test_unplugged_mid_round_stops_between_batches(tmp_path: Path) -> None:
    path = tmp_path / "conditions.json"
    path.write_text(json.dumps({"charging": True, "battery": 0.8, "network": "unmetered"}))
    work = order({"require_charging": True, "min_battery": 0.5})
    policy = job_policy(work.config_json)
    assert policy is not None and policy.require_charging
    check = stop_check(policy, LiteConditions(path))
    batches = 0

    def unplug_after_two() -> str | None:
        nonlocal batches
        batches += 1
        if batches == 3:  # the device is unplugged while batch 3 is about to run
            path.write_text(json.dumps({"charging": False, "battery": 0.8}))
        return check()

    result = LiteTrainer(shard()).train(work, initial_model(), unplug_after_two)
    assert result == Stopped("not charging", steps=2)
    path.write_text(json.dumps({"charging": True, "battery": 0.2}))
    assert check() == "battery 20%, below min_battery 50%"
    path.write_text('{"charging": tr')  # being rewritten: unknown, so not eligible
    assert check() == "charging unknown"
    assert stop_check(job_policy(order(None).config_json), LiteConditions(path))() is None


def test_conditions_file_is_read_strictly(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    assert LiteConditions(None).read() == DeviceConditions()
    path.write_text(json.dumps({"charging": True, "network": "wifi"}))
    with pytest.raises(SpecError, match=r"c\.json.*network must be one of"):
        LiteConditions(path).read()
    path.write_text(json.dumps({"charging": "yes"}))
    with pytest.raises(SpecError, match="charging must be true, false or null"):
        LiteConditions(path).read()
    with pytest.raises(SpecError, match="No such file"):
        LiteConditions(tmp_path / "absent.json").read()
    with pytest.raises(WireError, match="eligibility"):
        job_policy(json.dumps({"eligibility": {"min_battery": 2.0}}))


def test_credential_is_private_and_for_one_server(tmp_path: Path) -> None:
    state = LiteState(tmp_path / "d", "http://127.0.0.1:7071")
    assert state.credential() is None
    state.save_credential(DeviceCredential("dev-1", "s3cret"))
    path = tmp_path / "d" / "credential.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert LiteState(tmp_path / "d", "http://127.0.0.1:7071").credential() == (
        DeviceCredential("dev-1", "s3cret")
    )
    assert LiteState(tmp_path / "d", "http://other:7071").credential() is None
    path.write_text("{not json")
    assert state.credential() is None  # unreadable: enrol again, never crash
    state.forget_credential()
    assert not path.exists()


def test_job_state_in_the_state_dir_carries_momentum_across_restarts(tmp_path: Path) -> None:
    spec = JobSpec.from_dict({"train": {"update_momentum": 0.9}}).to_dict()
    config = json.dumps({k: spec[k] for k in ("train", "data", "compression")})
    work = WorkOrder("job", 1, "t", DIGITS, config, "", 0, 0.0, 1)
    model = initial_model()
    in_memory = LiteTrainer(shard())
    expected = [in_memory.train(work, model) for _ in range(2)]
    first = LiteTrainer(shard(), LiteState(tmp_path, "http://h:1")).train(work, model)
    second = LiteTrainer(shard(), LiteState(tmp_path, "http://h:1")).train(work, model)
    assert not isinstance(first, Stopped) and not isinstance(second, Stopped)
    assert [first.payload, second.payload] == [getattr(e, "payload", None) for e in expected]
    assert first.payload != second.payload, "the second round is smoothed by the first's"
    files = list((tmp_path / "jobs").iterdir())
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600


def test_command_line_checks_before_it_connects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "s.npz"
    s = shard()
    write_shard(data, {"x_train": s.x_train, "y_train": s.y_train, "x_val": s.x_val,
                       "y_val": s.y_val}, s.info)  # fmt: skip
    base = ["--token", "t", "--data", str(data)]
    cases = {
        "--server must look like http://HOST:PORT": ["--server", "127.0.0.1:7071", *base],
        "takes no path": ["--server", "http://h:1/device/v1", *base],
        "--tls-ca is for an https": ["--server", "http://h:1", "--tls-ca", str(data), *base],
        "not a shard file": ["--server", "http://h:1", "--token", "t", "--data", "nope.npz"],
        "conditions file": ["--server", "http://h:1", *base, "--conditions", str(data)],
    }
    for message, argv in cases.items():
        assert main(argv) == 2, message
        assert message in capsys.readouterr().err
    odd = tmp_path / "odd.npz"
    write_shard(odd, {"x_train": np.full((4, 8), 0.5), "y_train": np.zeros(4, np.int64),
                      "x_val": np.full((1, 8), 0.5), "y_val": np.zeros(1, np.int64)},
                s.info)  # fmt: skip
    assert main(["--server", "http://h:1", "--token", "t", "--data", str(odd)]) == 2
    assert "(N, 64)" in capsys.readouterr().err
