"""Training rounds through an exported ExecuTorch program: ``flotilla-lite --program DIR``.

DIR is what ``flotilla job export ID --format executorch --out DIR`` writes. The program
computes the task's loss, outputs and gradients, as a phone app's ExecuTorch runtime would;
this module loads each round's global model into the program's parameters and steps the
job's SGD (:class:`~flotilla.mobile.lite.mlp.SGD`, torch's semantics) over the gradients it
returns, batches in the NumPy trainer's order, so both trainers send the same update
through the same codecs. ExecuTorch (and the torch it runs on) is imported only when a
program is loaded, through :mod:`flotilla.mobile.runtime` (the ``mobile-export`` extra);
this module itself imports neither. ExecuTorch's training API is experimental.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from flotilla.core.blobs import sha256_hex
from flotilla.core.errors import SpecError, TaskLoadError, UpdateRejected
from flotilla.core.spec import TrainSection
from flotilla.core.tensors import DTYPES, ModelState, TensorSpec, check_layout, state_spec
from flotilla.core.update import COMPUTE_METRIC, LocalRound
from flotilla.mobile.lite.mlp import SGD, Examples, StopCheck, Stopped, batch_orders
from flotilla.mobile.lite.mlp import unsupported_train as _unsupported_train
from flotilla.mobile.manifest import MANIFEST_FILE, ExportManifest, ProgramInfo
from flotilla.mobile.runtime import as_inputs, load_training_module, training_runtime

PURPOSE = "flotilla-lite --program"
#: The program's output that holds the predicted labels (accuracy), when it has one.
PREDICTIONS = "predictions"
#: A sanity bound on the ``.pte`` read from DIR (the digits MLP's is ~220 KB).
MAX_PROGRAM_BYTES = 1 << 30


class ProgramTraining:
    """A :class:`~flotilla.mobile.lite.rounds.LocalTraining` through an exported program."""

    def __init__(self, manifest: ExportManifest, program: bytes) -> None:
        """Load ``program`` (the ``.pte`` bytes ``manifest`` describes); SpecError when
        ExecuTorch is missing or the program's parameters are not the manifest's."""
        if len(manifest.inputs) != 2:
            raise SpecError(
                f"the program takes {len(manifest.inputs)} inputs; the lite client feeds two "
                "(the examples and their labels)"
            )
        self.manifest = manifest
        # ExecuTorch runs from these bytes in place: they must live as long as the module.
        self._program = program
        self._module: Any = load_training_module(program, PURPOSE)
        self._layout = tuple(TensorSpec(p.name, p.dtype, p.shape) for p in manifest.parameters)
        self._params = self._bind()

    @classmethod
    def load(cls, directory: Path) -> ProgramTraining:
        """Read DIR's manifest strictly, check the program's SHA-256 and load it; SpecError
        (the install hint when ExecuTorch is missing) naming what is wrong."""
        training_runtime(PURPOSE)  # without ExecuTorch, that is the first thing to say
        manifest = ExportManifest.read(directory / MANIFEST_FILE)
        return cls(manifest, _read_program(directory, manifest.program))

    @property
    def tasks(self) -> tuple[str, ...]:
        return (self.manifest.task,)

    def layout(self, task: str, train: TrainSection) -> tuple[TensorSpec, ...]:
        if task != self.manifest.task:
            raise TaskLoadError(
                f"the exported program trains {self.manifest.task}; the round's task is {task}"
            )
        problem = _unsupported_train(train)
        if problem is None and train.proximal_mu > 0:
            problem = "the exported program computes no FedProx proximal term (proximal_mu > 0)"
        if problem is None and train.batch_size > self.manifest.program.max_batch:
            problem = (
                f"train.batch_size = {train.batch_size} exceeds the program's max_batch "
                f"{self.manifest.program.max_batch}: export the job again"
            )
        if problem is not None:
            raise SpecError(problem)
        return self._layout

    def check_examples(self, data: Examples) -> None:
        """SpecError when ``data`` is not what the program's inputs take."""
        for array, spec in zip((data.x, data.y), self.manifest.inputs, strict=False):
            if array.shape[1:] != spec.shape or array.dtype != DTYPES[spec.dtype]:
                raise SpecError(
                    f"the program's input {spec.name!r} takes {spec.dtype} {list(spec.shape)} "
                    f"per example; the data has {array.dtype} {list(array.shape[1:])}"
                )

    def fit(
        self,
        task: str,
        state: ModelState,
        data: tuple[Examples, Examples],
        train: TrainSection,
        seed: int,
        should_stop: StopCheck | None,
    ) -> LocalRound | Stopped:
        started = time.perf_counter()
        self.layout(task, train)
        for part in data:
            self.check_examples(part)
        self._load(state)
        fit, val = data
        trained = self._epochs(fit, train, seed, should_stop)
        if isinstance(trained, Stopped):
            return trained
        metrics = {**trained, COMPUTE_METRIC: time.perf_counter() - started}
        try:
            metrics.update(self._evaluate(val))
        except RuntimeError as exc:  # ExecuTorch's only error type
            steps = -(-len(fit.y) // train.batch_size) * train.local_epochs
            return Stopped(f"failed: the exported program did not run: {exc}", steps)
        params = {name: view.copy() for name, view in self._params.items()}
        return LocalRound(len(fit.y), metrics, params)

    def _bind(self) -> dict[str, np.ndarray]:
        """Wire name -> a NumPy view of the program's own parameter (writes reach it).
        ExecuTorch names the parameters only after a first run: one blank example."""
        self._run(tuple(np.zeros((1, *i.shape), DTYPES[i.dtype]) for i in self.manifest.inputs))
        named = self._module.named_parameters()
        wanted = {p.program_name for p in self.manifest.parameters}
        if set(named) != wanted:
            raise SpecError(
                f"the program trains {sorted(named)}; its manifest names {sorted(wanted)}"
            )
        views: dict[str, np.ndarray] = {}
        for spec, entry in zip(self._layout, self.manifest.parameters, strict=True):
            view = named[entry.program_name].numpy()
            if view.shape != spec.shape or view.dtype != DTYPES[spec.dtype]:
                raise SpecError(
                    f"the program's {entry.program_name} is {view.dtype} {list(view.shape)}; "
                    f"the manifest says {spec.dtype} {list(spec.shape)}"
                )
            views[spec.name] = view
        return views

    def _run(self, batch: tuple[np.ndarray, ...]) -> list[np.ndarray]:
        """The program's user outputs on ``batch``; its gradients wait in the module."""
        outputs = self._module.forward_backward(self.manifest.program.method, as_inputs(batch))
        return [out.numpy() for out in outputs]

    def _load(self, state: ModelState) -> None:
        """The round's global model into the program (UpdateRejected if it is not one)."""
        check_layout(state_spec(state), self._layout)
        if not all(np.isfinite(v).all() for v in state.values()):
            raise UpdateRejected("the global model holds NaN or Inf")
        for name, view in self._params.items():
            view[...] = state[name]

    def _epochs(
        self, data: Examples, train: TrainSection, seed: int, should_stop: StopCheck | None
    ) -> dict[str, float] | Stopped:
        """Minibatch SGD in the program; the task's ``train_loss``/``train_accuracy``."""
        opt = SGD(train.learning_rate, train.momentum, train.weight_decay)
        names = {p.program_name: p.name for p in self.manifest.parameters}
        total_loss, correct, steps = 0.0, 0, 0
        for order in batch_orders(len(data.y), seed, train.local_epochs):
            for start in range(0, len(order), train.batch_size):
                reason = should_stop() if should_stop is not None else None
                if reason is not None:
                    return Stopped(reason, steps)
                idx = order[start : start + train.batch_size]
                try:
                    outputs = self._run((data.x[idx], data.y[idx]))
                except RuntimeError as exc:  # ExecuTorch's only error type
                    return Stopped(f"failed: the exported program did not run: {exc}", steps)
                grads = {names[k]: g.numpy() for k, g in self._module.named_gradients().items()}
                opt.step(self._params, grads)
                total_loss += float(outputs[0]) * len(idx)
                correct += self._correct(outputs, data.y[idx])
                steps += 1
        seen = max(len(data.y) * train.local_epochs, 1)
        return {"train_loss": total_loss / seen, "train_accuracy": correct / seen}

    def _correct(self, outputs: list[np.ndarray], labels: np.ndarray) -> int:
        names = self.manifest.program.outputs
        if PREDICTIONS not in names:
            return 0
        return int((outputs[names.index(PREDICTIONS)] == labels).sum())

    def _evaluate(self, data: Examples) -> dict[str, float]:
        """The task's ``evaluate`` (accuracy, mean loss, count), in batches the program takes;
        the gradients it computes on the way are dropped."""
        if not len(data.y):
            return {"accuracy": 0.0, "loss": 0.0, "num_samples": 0.0}
        loss, correct = 0.0, 0
        step = self.manifest.program.max_batch
        for start in range(0, len(data.y), step):
            x, y = data.x[start : start + step], data.y[start : start + step]
            outputs = self._run((x, y))
            loss += float(outputs[0]) * len(y)
            correct += self._correct(outputs, y)
        n = len(data.y)
        return {"accuracy": correct / n, "loss": loss / n, "num_samples": float(n)}


def _read_program(directory: Path, info: ProgramInfo) -> bytes:
    """The ``.pte`` the manifest names, in DIR, with the manifest's size and SHA-256."""
    if Path(info.file).name != info.file or info.file in ("", ".", ".."):
        raise SpecError(f"the manifest's program file must be a name in {directory}: {info.file!r}")
    path = directory / info.file
    try:
        size = path.stat().st_size
        if size > MAX_PROGRAM_BYTES:
            raise SpecError(f"{path}: {size} bytes is larger than a training program can be")
        program = path.read_bytes()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read the program: {exc}") from exc
    if len(program) != info.size or sha256_hex(program) != info.sha256:
        raise SpecError(f"{path} is not the program its manifest describes (size or SHA-256)")
    return program
