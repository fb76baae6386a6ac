"""The lite client runs on the base install alone (``pip install flotilla``, no extras):
torch, grpc and the server stack cannot be imported there, ``flotilla-lite --help`` works,
and a round trained there is the torch agent's update (computed here, with torch)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flotilla.client import LocalTrainer, TrainWork
from flotilla.core.round_config import RoundConfig
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import decode_state, encode_state, state_spec
from flotilla.mobile.lite import ShardInfo, write_shard
from flotilla.tasks import DigitsTask, Shard, ShardTraining, model_state
from tests.support.base_venv import BaseVenv

# One worker holds the session's base-install venv (made once, ~10 s) for every test using it.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.xdist_group("base-venv")]

DIGITS = "flotilla.tasks.digits:DigitsTask"
#: Run inside the base venv: what it can import, then one round of the lite trainer.
ROUND_SCRIPT = """
import importlib.util, json, sys
from pathlib import Path
absent = [m for m in ("torch", "grpc", "sklearn", "sqlalchemy", "aiohttp", "hivemind")
          if importlib.util.find_spec(m) is not None]
from flotilla.core.work import WorkOrder
from flotilla.mobile.lite import LiteTrainer, read_shard
here = Path(sys.argv[1])
order = WorkOrder(**json.loads((here / "order.json").read_text()))
update = LiteTrainer(read_shard(here / "shard.npz")).train(order, (here / "model").read_bytes())
(here / "update").write_bytes(update.payload)
loaded = sorted({m.split(".")[0] for m in sys.modules} - set(sys.stdlib_module_names))
print(json.dumps({"installed": absent, "loaded": loaded, "file": __import__("flotilla").__file__}))
"""


def test_lite_runs_on_the_base_install(base_venv: BaseVenv, tmp_path: Path) -> None:
    for module in ("torch", "grpc"):
        done = base_venv.run([str(base_venv.python), "-c", f"import {module}"], tmp_path)
        assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr, module
    for argv in ([str(base_venv.script("flotilla-lite")), "--help"],
                 [str(base_venv.python), "-m", "flotilla.mobile.lite", "--help"]):  # fmt: skip
        done = base_venv.run(argv, tmp_path, check=True)
        assert "--server" in done.stdout and "--conditions" in done.stdout

    task, shard, seed = DigitsTask(), Shard(3, 8), 77
    spec = JobSpec()
    local = task.load_shard(shard, spec.data)
    arrays = dict(zip(("x_train", "y_train", "x_val", "y_val"),
                      (t.numpy() for t in (*local.train, *local.val)), strict=True))  # fmt: skip
    info = ShardInfo(DIGITS, shard.index, shard.count, spec.data.alpha, spec.data.seed, {})
    write_shard(tmp_path / "shard.npz", arrays, info)
    (tmp_path / "phone").mkdir()
    done = base_venv.run(
        [str(base_venv.script("flotilla-lite")), "--server", "http://127.0.0.1:1", "--token", "t",
         "--data", str(tmp_path / "shard.npz"), "--program", str(tmp_path / "phone")], tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr  # training through an export needs ExecuTorch
    assert "pip install 'flotilla[mobile-export]'" in done.stderr and "Traceback" not in done.stderr
    model = encode_state(model_state(task.build_model(5)))
    (tmp_path / "model").write_bytes(model)
    full = spec.to_dict()
    config = json.dumps({k: full[k] for k in ("train", "data", "compression")})
    order = {"job_id": "j", "round": 1, "round_token": "t", "task": DIGITS,
             "config_json": config, "model_sha256": "", "model_size": len(model),
             "deadline": 0.0, "seed": seed}  # fmt: skip
    (tmp_path / "order.json").write_text(json.dumps(order))

    done = base_venv.run(
        [str(base_venv.python), "-c", ROUND_SCRIPT, str(tmp_path)], tmp_path, check=True
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["installed"] == []
    heavy = {"torch", "grpc", "google", "sqlalchemy", "aiohttp", "sklearn"}
    # numpy trains; cryptography (a small wheel) signs every update with the device's key
    assert not heavy & set(report["loaded"]), report["loaded"]
    assert report["file"].startswith(str(base_venv.root)), "the installed package, not this tree"

    theirs = LocalTrainer(ShardTraining(DIGITS, shard, task=task)).train(
        model, TrainWork("j", seed, RoundConfig.from_json(config))
    )
    layout = state_spec(decode_state(model))
    got = decode_state((tmp_path / "update").read_bytes(), layout)
    want = decode_state(theirs.payload, layout)
    assert max(float(np.abs(got[k] - want[k]).max()) for k in want) < 1e-5
