"""``flotilla-lite --program DIR``: the lite client trains through the ExecuTorch program
``flotilla job export`` wrote, and sends the update its NumPy trainer would (same batches,
same SGD, same codecs); it refuses rounds the program cannot do by name, says how to
install ExecuTorch when it is missing, and serves a real server's rounds with it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flotilla.core.errors import SpecError
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import decode_state, encode_state, state_spec
from flotilla.core.work import WorkOrder
from flotilla.mobile.export import ExportSource, build_training_program, write_program
from flotilla.mobile.lite import LiteTrainer, ShardFile, ShardInfo, Stopped, write_shard
from flotilla.mobile.lite.__main__ import main as lite_main
from flotilla.mobile.lite.program import ProgramTraining
from flotilla.tasks import DigitsTask, Shard, model_state
from tests.support.lifetime import bound
from tests.support.processes import ServerProcess, flotilla

pytest.importorskip("executorch.extension.training")
pytestmark = pytest.mark.filterwarnings("ignore:This API is experimental")  # ExecuTorch says so

DIGITS = "flotilla.tasks.digits:DigitsTask"
WIDE = "flotilla.tasks.digits:WideDigitsTask"
SHARD = Shard(1, 4)
TRAIN = {"local_epochs": 2, "batch_size": 16, "learning_rate": 0.1, "momentum": 0.5,
         "weight_decay": 1e-3, "update_momentum": 0.5}  # fmt: skip


def spec_with(**train: Any) -> JobSpec:
    return JobSpec.from_dict(
        {"job": {"task": DIGITS, "seed": 7}, "train": {**TRAIN, **train},
         "data": {"alpha": 0.5, "seed": 3}}
    )  # fmt: skip


def order(spec: JobSpec, seed: int, round_no: int = 1) -> WorkOrder:
    full = spec.to_dict()
    config = {k: full[k] for k in ("train", "data", "compression")}
    return WorkOrder("job-1", round_no, f"tok{round_no}", DIGITS, json.dumps(config), "", 0,
                     0.0, seed)  # fmt: skip


@pytest.fixture(scope="module")
def shard() -> ShardFile:
    spec = spec_with()
    local = DigitsTask().load_shard(SHARD, spec.data)
    info = ShardInfo(DIGITS, SHARD.index, SHARD.count, spec.data.alpha, spec.data.seed, {})
    return ShardFile(*(t.numpy() for t in (*local.train, *local.val)), info=info)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits job exported as ``flotilla job export --format executorch`` writes it."""
    model = encode_state(model_state(DigitsTask().build_model(7)))
    out = tmp_path_factory.mktemp("phone")
    write_program(build_training_program(ExportSource("job-1", 0, spec_with(), model)), out)
    return out


@pytest.mark.timeout(120)
def test_a_round_through_the_program_sends_the_numpy_trainers_update(
    exported: Path, shard: ShardFile
) -> None:
    """Two rounds from the same global model, shard and seeds (update momentum carries
    over): the uploaded deltas and the metrics agree to 1e-4."""
    spec = spec_with()
    numpy_lite = LiteTrainer(shard)
    program_lite = LiteTrainer(shard, training=ProgramTraining.load(exported))
    assert program_lite.tasks == (DIGITS,)
    model = encode_state(model_state(DigitsTask().build_model(7)))
    layout = state_spec(decode_state(model))
    for round_no, seed in ((1, 2024), (2, 99)):
        work = order(spec, seed, round_no)
        want, got = numpy_lite.train(work, model), program_lite.train(work, model)
        assert not isinstance(want, Stopped) and not isinstance(got, Stopped)
        a, b = decode_state(want.payload, layout), decode_state(got.payload, layout)
        worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
        assert worst < 1e-4, f"round {round_no}: deltas differ by {worst}"
        assert max(float(np.abs(a[k]).max()) for k in a) > 1e-2, "the round trained nothing"
        assert (got.num_samples, got.codec) == (want.num_samples, "none")
        for name in ("train_loss", "train_accuracy", "accuracy", "loss", "num_samples"):
            assert got.metrics[name] == pytest.approx(want.metrics[name], abs=1e-4), name
        model = encode_state({k: decode_state(model)[k] + a[k] for k in a})


def test_what_the_program_cannot_train_is_named(exported: Path, shard: ShardFile) -> None:
    lite = LiteTrainer(shard, training=ProgramTraining.load(exported))
    wide = dataclasses.replace(order(spec_with(), 1), task=WIDE)
    assert (
        lite.unsupported(wide)
        == f"the exported program trains {DIGITS}; the round's task is {WIDE}"
    )
    problem = lite.unsupported(order(spec_with(proximal_mu=0.1), 1))
    assert problem is not None and "FedProx" in problem
    problem = lite.unsupported(order(spec_with(batch_size=64), 1))
    assert problem is not None and "exceeds the program's max_batch 16" in problem
    assert lite.unsupported(order(spec_with(), 1)) is None


def test_a_program_that_is_not_its_manifests_is_refused(exported: Path, tmp_path: Path) -> None:
    manifest = json.loads((exported / "manifest.json").read_text())
    (tmp_path / "model.pte").write_bytes((exported / "model.pte").read_bytes()[:-1] + b"\0")
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SpecError, match="is not the program its manifest describes"):
        ProgramTraining.load(tmp_path)
    (tmp_path / "model.pte").write_bytes((exported / "model.pte").read_bytes())
    manifest["parameters"][0]["shape"] = [256, 65]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        SpecError, match=r"model\.net\.0\.weight is float32 \[256, 64\]; the manifest"
    ):
        ProgramTraining.load(tmp_path)


def test_without_executorch_the_cli_says_how_to_install_it(
    exported: Path, shard: ShardFile, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    data = tmp_path / "shard.npz"
    write_shard(
        data, {k: getattr(shard, k) for k in ("x_train", "y_train", "x_val", "y_val")}, shard.info
    )
    for name in ("executorch", "executorch.extension", "executorch.extension.training"):
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    argv = ["--server", "http://127.0.0.1:1", "--token", "t", "--data", str(data),
            "--program", str(exported)]  # fmt: skip
    assert lite_main(argv) == 2
    err = capsys.readouterr().err
    assert "flotilla-lite --program needs ExecuTorch" in err
    assert "pip install 'flotilla[mobile-export]'" in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_lite_device_trains_a_real_servers_rounds_through_the_export(
    server: ServerProcess, digits_spec: Path, tmp_path: Path
) -> None:
    """The job exported from the server, then ``flotilla-lite --program`` as the only device:
    its updates are accepted and the rounds commit."""
    job_id = server.submit(
        digits_spec, "job.rounds=2", "job.clients_per_round=1", "job.min_quorum=1"
    )
    phone = tmp_path / "phone"
    server.operator("job", "export", job_id, "--format", "executorch", "--out", str(phone),
                    timeout=120)  # fmt: skip
    data = tmp_path / "shard.npz"
    flotilla("data", "shard", "--task", DIGITS, "--shard", "0/4", "--alpha", "0.5",
             "--out", str(data))  # fmt: skip
    log = tmp_path / "lite.log"
    cmd = [
        sys.executable, "-m", "flotilla.mobile.lite", "--server",
        f"http://127.0.0.1:{server.http_port}", "--token", server.token(), "--data", str(data),
        "--program", str(phone), "--device-class", "pte", "--state-dir", str(tmp_path / "d"),
    ]  # fmt: skip
    with log.open("w") as out:
        lite = subprocess.Popen(bound(cmd), stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        status = server.wait_for(job_id, timeout=90)
        assert status["state"] == "completed", (status, log.read_text()[-3000:])
        devices = json.loads(server.operator("devices", "list", "--json").stdout)
        (device,) = [d["id"] for d in devices if d.get("device_class") == "pte"]
        rounds = server.status(job_id, rounds=True)["rounds"]
        assert len(rounds) == 2 and all(r["participants"] == [device] for r in rounds), rounds
        assert log.read_text().count(": accepted") == 2, log.read_text()[-3000:]
        assert lite.poll() is None, "the lite client died"
    finally:
        lite.terminate()
        try:
            lite.wait(20)
        except subprocess.TimeoutExpired:
            lite.kill()
