"""``flotilla job export --format executorch``: a job's model as an ExecuTorch training
program that really trains in ExecuTorch's runtime, exactly as PyTorch would, and the
manifest a device app reads to drive it."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from flotilla.core.blobs import sha256_hex
from flotilla.core.errors import FlotillaError, SpecError
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import decode_state, encode_state
from flotilla.mobile.export import (
    PROGRAM_FILE,
    ExportSource,
    build_training_program,
    executorch_version,
    exportable_task,
)
from flotilla.mobile.manifest import ExportManifest
from flotilla.tasks import load_model_state, model_state
from flotilla.tasks.digits import DigitsTask
from tests.support.docrun import REPO, parse_blocks, run_page
from tests.support.live_grpc import LiveServer, live_server, run_cli

pytest.importorskip("executorch.extension.training")
from executorch.extension.training import (
    _load_for_executorch_for_training_from_buffer,
    get_sgd_optimizer,
)

pytestmark = pytest.mark.filterwarnings("ignore:This API is experimental")  # ExecuTorch says so

DIGITS = "flotilla.tasks.digits:DigitsTask"
BATCH, STEPS = 16, 20
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 1e-3


def separable(n: int = 5 * BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Ten classes, each lighting its own six pixels: a line separates every pair."""
    gen = torch.Generator().manual_seed(7)
    y = torch.arange(n) % 10
    x = 0.1 * torch.rand(n, 64, generator=gen)
    for i, label in enumerate(y.tolist()):
        x[i, 6 * label : 6 * label + 6] = 1.0
    return x, y


def digits_source(seed: int = 3) -> ExportSource:
    spec = JobSpec.from_dict(
        {
            "job": {"task": DIGITS, "seed": seed, "name": "phone"},
            "train": {
                "batch_size": BATCH,
                "learning_rate": LR,
                "momentum": MOMENTUM,
                "weight_decay": WEIGHT_DECAY,
                "local_epochs": 2,
            },
        }
    )
    model = DigitsTask().build_model(seed)
    return ExportSource("job-1", 4, spec, encode_state(model_state(model)))


@pytest.mark.timeout(120)
def test_exported_program_trains_in_executorch_like_pytorch() -> None:
    source = digits_source()
    started = time.monotonic()
    exported = build_training_program(source)
    export_s = time.monotonic() - started
    manifest = exported.manifest
    assert export_s < 60, f"exporting the digits MLP took {export_s:.1f}s"

    # The manifest describes the model as it travels on the wire.
    task = DigitsTask()
    reference = task.build_model(0)
    load_model_state(reference, decode_state(source.model))
    state = model_state(reference)
    assert [p.name for p in manifest.parameters] == list(state)
    assert [p.shape for p in manifest.parameters] == [v.shape for v in state.values()]
    assert all(p.dtype == "F32" for p in manifest.parameters)
    assert [p.sha256 for p in manifest.parameters] == [
        sha256_hex(v.tobytes()) for v in state.values()
    ]
    assert manifest.program.sha256 == sha256_hex(exported.program)
    assert manifest.program.outputs == ("loss", "predictions")
    assert (manifest.job_id, manifest.round, manifest.task) == ("job-1", 4, DIGITS)
    assert manifest.model_sha256 == sha256_hex(source.model)
    assert [(i.name, i.shape, i.dtype) for i in manifest.inputs] == [
        ("inputs", (64,), "F32"), ("labels", (), "I64"),
    ]  # fmt: skip
    training = manifest.training
    assert (training.learning_rate, training.momentum, training.weight_decay) == (
        LR, MOMENTUM, WEIGHT_DECAY,
    )  # fmt: skip
    assert (training.batch_size, training.local_epochs, training.optimizer) == (BATCH, 2, "sgd")

    # The same SGD steps on the same batches in both runtimes.
    program = _load_for_executorch_for_training_from_buffer(exported.program)
    names = {p.name: p.program_name for p in manifest.parameters}
    opt = torch.optim.SGD(
        reference.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY
    )
    x, y = separable()
    batches = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(y), BATCH)]
    before = np.mean([float(program.forward_backward("forward", b)[0]) for b in batches])
    sgd = get_sgd_optimizer(program.named_parameters(), LR, MOMENTUM, 0, WEIGHT_DECAY, False)
    for step in range(STEPS):
        xb, yb = batches[step % len(batches)]
        et_loss = program.forward_backward("forward", (xb, yb))[0]
        sgd.step(program.named_gradients())
        pt_loss = torch.nn.functional.cross_entropy(reference(xb), yb)
        opt.zero_grad()
        pt_loss.backward()
        opt.step()
        assert float(et_loss) == pytest.approx(float(pt_loss.detach()), abs=1e-4), step
    after = np.mean([float(program.forward_backward("forward", b)[0]) for b in batches])
    assert after <= 0.5 * before, (before, after)
    trained = program.named_parameters()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(trained[names[name]], tensor, atol=1e-4, rtol=0)

    # A device loads each round's global model into the same program: a batch of 3 too.
    fresh = task.build_model(11)
    with torch.no_grad():
        for name, tensor in fresh.state_dict().items():
            trained[names[name]].copy_(tensor)
    xb, yb = x[:3], y[:3]
    loss, predictions = program.forward_backward("forward", (xb, yb))
    expected = fresh(xb)
    assert float(loss) == pytest.approx(float(torch.nn.functional.cross_entropy(expected, yb)))
    assert predictions.tolist() == expected.argmax(dim=1).tolist()


def test_manifest_round_trips_and_refuses_what_it_does_not_know(tmp_path: Path) -> None:
    manifest = build_training_program(digits_source()).manifest
    path = tmp_path / "manifest.json"
    path.write_text(manifest.to_json())
    assert ExportManifest.read(path) == manifest

    data = json.loads(path.read_text())
    with pytest.raises(SpecError, match=r"unknown field 'program\.bogus'"):
        ExportManifest.from_dict({**data, "program": {**data["program"], "bogus": 1}})
    del data["parameters"][1]["sha256"]
    with pytest.raises(SpecError, match=r"missing field\(s\) parameters\[1\]\.sha256"):
        ExportManifest.from_dict(data)
    with pytest.raises(SpecError, match="manifest version 2 is not supported"):
        ExportManifest.from_dict({**json.loads(manifest.to_json()), "manifest_version": 2})
    path.write_text("{not json")
    with pytest.raises(SpecError, match="not a readable JSON manifest"):
        ExportManifest.read(path)


def test_a_task_without_the_export_protocol_or_a_fedprox_job_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(SpecError, match=r"task flotilla\.tasks\.synthetic:Linear100K cannot be"):
        exportable_task("flotilla.tasks.synthetic:Linear100K")
    source = digits_source()
    fedprox = JobSpec.from_dict({**source.spec.to_dict(), "aggregation": {"strategy": "fedprox"}})
    with pytest.raises(SpecError, match="proximal term"):
        build_training_program(ExportSource("j", 0, fedprox, source.model))
    monkeypatch.setitem(sys.modules, "executorch", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "executorch.exir", None)
    with pytest.raises(FlotillaError, match=r"pip install 'flotilla\[mobile-export\]'"):
        executorch_version()


async def commit_one_round(live: LiveServer, job_id: str) -> None:
    """A device takes round 1 and sends a small update; the server commits it."""
    device = await live.enrol()
    task = await live.poll_task(device)
    await live.good_update_commits(job_id, device, task, await live.fetch(device, task))


@pytest.mark.timeout(180)
async def test_cli_exports_the_committed_model_of_a_real_server(tmp_path: Path) -> None:
    async with live_server(tmp_path / "state") as live:
        job_id = await live.submit()
        await commit_one_round(live, job_id)
        job = await live.store.get_job(job_id)
        assert job is not None and job.rounds_committed == 1
        where = ("--server", f"127.0.0.1:{live.port}", "--token", live.operator_token)

        out = tmp_path / "phone"
        result = await run_cli(
            "job", "export", job_id, "--format", "executorch", "--out", str(out), *where,
            timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result
        assert f"job {job_id} round 1" in result.stdout and "model.pte" in result.stdout
        assert "Traceback" not in result.stderr
        assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model.pte"]
        manifest = ExportManifest.read(out / "manifest.json")
        assert (manifest.job_id, manifest.round, manifest.task) == (job_id, 1, DIGITS)
        assert manifest.model_sha256 == job.checkpoint_sha256
        pte = (out / PROGRAM_FILE).read_bytes()
        assert manifest.program.sha256 == sha256_hex(pte) and manifest.program.size == len(pte)

        # Without --format the export is the safetensors model it always was.
        plain = tmp_path / "model.safetensors"
        result = await run_cli("job", "export", job_id, "--out", str(plain), *where)
        assert result.returncode == 0, result
        assert sha256_hex(plain.read_bytes()) == job.checkpoint_sha256
        committed = decode_state(plain.read_bytes())
        assert [p.name for p in manifest.parameters] == list(committed)
        assert [p.shape for p in manifest.parameters] == [v.shape for v in committed.values()]

        # The program holds the committed weights.
        program = _load_for_executorch_for_training_from_buffer(pte)
        program.forward_backward("forward", separable(BATCH))
        held = program.named_parameters()
        for entry in manifest.parameters:
            np.testing.assert_array_equal(held[entry.program_name].numpy(), committed[entry.name])


@pytest.mark.timeout(120)
async def test_cli_refuses_a_task_that_cannot_be_exported(tmp_path: Path) -> None:
    async with live_server(tmp_path / "state") as live:
        job_id = await live.submit("job.task=flotilla.tasks.synthetic:Linear100K")
        out = tmp_path / "phone"
        result = await run_cli(
            "job", "export", job_id, "--format", "executorch", "--out", str(out),
            "--server", f"127.0.0.1:{live.port}", "--token", live.operator_token,
        )  # fmt: skip
        assert result.returncode == 2, result
        assert "task flotilla.tasks.synthetic:Linear100K cannot be exported" in result.stderr
        assert "Traceback" not in result.stderr and not out.exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_page_exports_a_job_and_trains_it_as_a_device_would(tmp_path: Path) -> None:
    page = REPO / "docs" / "mobile-export.md"
    blocks = parse_blocks(page.read_text())
    assert [b.file for b in blocks if b.file] == ["train_on_device.py"]
    (tmp_path / "examples").symlink_to(REPO / "examples")
    run = run_page(page, tmp_path, block_timeout=120.0)
    tail = "\n".join(run.output.splitlines()[-40:])
    assert run.timed_out_block is None and run.returncode == 0, tail
    before, after = map(float, re.findall(r"loss ([0-9.]+) -> ([0-9.]+)", run.output)[0])
    assert after < 0.8 * before, tail
    manifest = ExportManifest.read(tmp_path / "phone" / "manifest.json")
    assert manifest.round == 0
    trained = load_file(tmp_path / "trained.safetensors")
    assert sorted(trained) == sorted(p.name for p in manifest.parameters)
