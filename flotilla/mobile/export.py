"""A job's model as an ExecuTorch training program, so a phone app can train it on device.

The task's training module (model + loss, :class:`flotilla.tasks.ExportableTask`) is traced
with ``torch.export`` on an example batch whose first dimension is left dynamic, joined with
its backward graph (``_export_forward_backward``) and lowered with
``executorch.exir.to_edge(...).to_executorch()``. The result's method ``forward`` returns the
loss (and the module's other outputs), then the gradients, then the parameters: what
ExecuTorch's (experimental) ``TrainingModule`` and its SGD expect. ExecuTorch is an optional
dependency (the ``mobile-export`` extra), imported only here and only when exporting.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from flotilla.core.blobs import sha256_hex
from flotilla.core.errors import FlotillaError, SpecError
from flotilla.core.files import write_atomic
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import DTYPES, ModelState, decode_state, state_spec
from flotilla.mobile.manifest import (
    DEVICE_PROTOCOL_VERSION,
    MANIFEST_FILE,
    MANIFEST_VERSION,
    PROGRAM_FILE,
    BatchInput,
    ExportManifest,
    ParameterEntry,
    ProgramInfo,
    TrainingSettings,
)
from flotilla.mobile.runtime import EXECUTORCH_VERSION, INSTALL_HINT, quiet_import
from flotilla.tasks.base import ExportableTask, load_model_state, load_task, model_state

if TYPE_CHECKING:
    import torch

_INPUT_NAMES = ("inputs", "labels")


@dataclass(frozen=True, slots=True)
class ExportSource:
    """A job's model as the server committed it: what an export starts from."""

    job_id: str
    #: The committed round whose model ``model`` is (0: the initial model).
    round: int
    spec: JobSpec
    #: The model as safetensors bytes, exactly as the server serves it.
    model: bytes


@dataclass(frozen=True, slots=True)
class TrainingProgram:
    """The ``.pte`` bytes and the manifest that describes them."""

    program: bytes
    manifest: ExportManifest


def exportable_task(entrypoint: str) -> ExportableTask:
    """The job's task, if it declares how to export its training step (SpecError if not)."""
    task = load_task(entrypoint)
    if not isinstance(task, ExportableTask):
        raise SpecError(
            f"task {entrypoint} cannot be exported: it does not implement "
            "flotilla.tasks.ExportableTask (training_module and example_batch)"
        )
    return task


def check_exportable_job(spec: JobSpec) -> None:
    """Refuse jobs whose local training the program would not reproduce."""
    if spec.aggregation.strategy == "fedprox" or spec.train.proximal_mu > 0:
        raise SpecError(
            f"job {spec.job.name!r} cannot be exported: its local loss adds FedProx's "
            "proximal term, which the exported program does not compute"
        )


def executorch_version() -> str:
    """The installed ExecuTorch's version, or a FlotillaError that says how to install it."""
    try:
        from importlib.metadata import version

        with quiet_import():
            import executorch.exir  # noqa: F401
    except ImportError as exc:
        raise FlotillaError(
            f"exporting for ExecuTorch needs executorch=={EXECUTORCH_VERSION}: {INSTALL_HINT} "
            f"({exc})"
        ) from exc
    return version("executorch")


def build_training_program(source: ExportSource) -> TrainingProgram:
    """Trace, differentiate and lower the job's training step with ``source``'s weights."""
    spec = source.spec
    check_exportable_job(spec)
    task = exportable_task(spec.job.task)
    et_version = executorch_version()
    import torch

    model = task.build_model(spec.job.seed)
    state = decode_state(source.model, expected=state_spec(model_state(model)))
    load_model_state(model, state)
    step = task.training_module(model)
    names = program_names(spec.job.task, model, step)
    max_batch = max(spec.train.batch_size, 2)  # a dimension of 1 would be specialised away
    example = task.example_batch(max_batch)
    outputs = _output_names(spec.job.task, step, example)
    program = lower(step, example, max_batch, tuple(names.values()))
    manifest = ExportManifest(
        manifest_version=MANIFEST_VERSION,
        protocol_version=DEVICE_PROTOCOL_VERSION,
        task=spec.job.task,
        job_id=source.job_id,
        round=source.round,
        model_sha256=sha256_hex(source.model),
        program=ProgramInfo(
            file=PROGRAM_FILE,
            format="executorch",
            sha256=sha256_hex(program),
            size=len(program),
            method="forward",
            outputs=outputs,
            max_batch=max_batch,
            executorch_version=et_version,
            torch_version=torch.__version__,
        ),
        inputs=tuple(_input(name, t) for name, t in zip(_INPUT_NAMES, example, strict=True)),
        parameters=_parameters(state, names),
        training=_training(spec),
    )
    return TrainingProgram(program, manifest)


def program_names(entrypoint: str, model: torch.nn.Module, step: torch.nn.Module) -> dict[str, str]:
    """Each model tensor's wire name -> its name in the training module (and the program).

    Every tensor of the model's state must be a parameter the step trains: a buffer (batch
    norm statistics) would stay frozen in the program, so such a model is refused.
    """
    in_step = {id(p): name for name, p in step.named_parameters()}
    params = dict(model.named_parameters())
    frozen = [name for name in model.state_dict() if name not in params]
    if frozen:
        raise SpecError(
            f"task {entrypoint} cannot be exported: its model's buffers {frozen} would not "
            "be updated by the training program"
        )
    untrained = [n for n, p in params.items() if id(p) not in in_step or not p.requires_grad]
    if untrained:
        raise SpecError(
            f"task {entrypoint} cannot be exported: its training module does not train "
            f"the model's parameters {untrained}"
        )
    return {name: in_step[id(p)] for name, p in params.items()}


def _output_names(
    entrypoint: str, step: torch.nn.Module, example: tuple[torch.Tensor, torch.Tensor]
) -> tuple[str, ...]:
    """``loss`` and the step's other outputs (named by its ``output_names``, if it has them)."""
    import torch

    with torch.no_grad():
        out = step(*example)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    loss = outs[0]
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.is_floating_point():
        raise SpecError(
            f"task {entrypoint} cannot be exported: its training module's first output "
            "must be the batch's scalar loss"
        )
    declared = getattr(step, "output_names", None)
    if isinstance(declared, tuple) and len(declared) == len(outs) and declared[0] == "loss":
        return tuple(str(n) for n in declared)
    return ("loss", *(f"output_{i}" for i in range(1, len(outs))))


def lower(
    step: torch.nn.Module,
    example: tuple[torch.Tensor, ...],
    max_batch: int,
    expected_names: tuple[str, ...],
) -> bytes:
    """The ExecuTorch training program (``.pte`` bytes) of ``step``, batch dimension dynamic."""
    from executorch.exir import to_edge
    from torch.export import Dim, export
    from torch.export.experimental import _export_forward_backward

    batch = Dim("batch", min=1, max=max_batch)
    with warnings.catch_warnings():  # torch 2.13's own export internals use a deprecated API
        warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)`", FutureWarning)
        dynamic = tuple({0: batch} for _ in example)
        traced = export(step, example, dynamic_shapes=dynamic, strict=True)
        joint = _export_forward_backward(traced)
        trained = tuple(joint.graph_signature.parameters)
        if sorted(trained) != sorted(expected_names):
            raise FlotillaError(
                f"the exported program trains {sorted(trained)}, expected {sorted(expected_names)}"
            )
        return bytes(to_edge(joint).to_executorch().buffer)


def _input(name: str, tensor: torch.Tensor) -> BatchInput:
    dtype = np.dtype(tensor.detach().cpu()[:0].numpy().dtype)
    wire = next((k for k, v in DTYPES.items() if v == dtype), None)
    if wire is None:
        raise SpecError(f"input {name!r}: dtype {tensor.dtype} has no wire name")
    return BatchInput(name=name, shape=tuple(int(d) for d in tensor.shape[1:]), dtype=wire)


def _parameters(state: ModelState, names: dict[str, str]) -> tuple[ParameterEntry, ...]:
    specs = {s.name: s for s in state_spec(state)}
    return tuple(
        ParameterEntry(
            name=name,
            program_name=names[name],
            shape=specs[name].shape,
            dtype=specs[name].dtype,
            sha256=sha256_hex(np.ascontiguousarray(value).tobytes()),
        )
        for name, value in state.items()
    )


def _training(spec: JobSpec) -> TrainingSettings:
    train = spec.train
    return TrainingSettings(
        optimizer="sgd",
        learning_rate=train.learning_rate,
        momentum=train.momentum,
        weight_decay=train.weight_decay,
        local_epochs=train.local_epochs,
        batch_size=train.batch_size,
        update_momentum=train.update_momentum,
    )


def write_program(exported: TrainingProgram, out_dir: Path) -> tuple[Path, Path]:
    """``out_dir/model.pte`` then ``out_dir/manifest.json`` (which names the program's
    SHA-256), each replaced whole."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pte, manifest = out_dir / PROGRAM_FILE, out_dir / MANIFEST_FILE
    write_atomic(pte, exported.program)
    write_atomic(manifest, exported.manifest.to_json().encode())
    return pte, manifest
