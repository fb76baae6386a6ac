"""The digits task's model, loss and SGD in NumPy, step for step what ``flotilla.tasks.digits``
does with torch, so a device without torch sends the same update a torch agent would.

The model is ``DigitsMLP``: pixels in [0, 1] recentred to [-1, 1], Linear/ReLU layers, a
10-way Linear, trained on the mean cross-entropy (plus FedProx's proximal term) by torch's
SGD (momentum, weight decay). Parameters carry the torch ``state_dict`` names
(``net.0.weight`` ...), float32, so the wire cannot tell the two apart. The batch order is
torch's ``randperm`` under ``Generator().manual_seed(seed)``, rebuilt from the same Mersenne
Twister (:func:`batch_orders`): both trainers are pure functions of the round's seed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from flotilla.core.errors import SpecError, TaskLoadError, UpdateRejected
from flotilla.core.spec import TrainSection
from flotilla.core.tensors import ModelState, TensorSpec, check_layout, state_spec
from flotilla.core.update import COMPUTE_METRIC, LocalRound

INPUTS = 64
CLASSES = 10
#: The tasks this trainer implements, by entry point, with their hidden widths.
TASKS: Mapping[str, tuple[int, ...]] = MappingProxyType(
    {
        "flotilla.tasks.digits:DigitsTask": (256, 128),
        "flotilla.tasks.digits:WideDigitsTask": (1024, 512),
    }
)
_F = np.float32
#: Checked between batches; a reason to stop (conditions changed), or None to go on.
StopCheck = Callable[[], "str | None"]


@dataclass(frozen=True, slots=True)
class Stopped:
    """Training ended early: ``reason`` is what the device reports to the server."""

    reason: str
    #: SGD steps taken before stopping.
    steps: int


@dataclass(frozen=True, slots=True)
class Examples:
    """Inputs (N, 64) float32 in [0, 1] and labels (N,) int64 in 0..9."""

    x: np.ndarray
    y: np.ndarray


@dataclass(frozen=True, slots=True)
class DigitsModel:
    """The MLP of one digits task: ``64 -> hidden... -> 10``."""

    hidden: tuple[int, ...]

    @classmethod
    def for_task(cls, task: str) -> DigitsModel:
        """The model of ``task`` (an entry point); TaskLoadError for one not in :data:`TASKS`."""
        hidden = TASKS.get(task)
        if hidden is None:
            raise TaskLoadError(
                f"flotilla-lite trains only {', '.join(TASKS)}; the job's task is {task!r}"
            )
        return cls(hidden)

    @property
    def widths(self) -> tuple[int, ...]:
        return (INPUTS, *self.hidden, CLASSES)

    def layout(self) -> tuple[TensorSpec, ...]:
        """Names, dtypes and shapes of the torch model's ``state_dict``, in its order."""
        specs: list[TensorSpec] = []
        for i, (d_in, d_out) in enumerate(zip(self.widths, self.widths[1:], strict=False)):
            specs.append(TensorSpec(f"net.{2 * i}.weight", "F32", (d_out, d_in)))
            specs.append(TensorSpec(f"net.{2 * i}.bias", "F32", (d_out,)))
        return tuple(specs)

    def params(self, state: Mapping[str, np.ndarray]) -> ModelState:
        """Writable float32 copies of ``state``; UpdateRejected if its layout is not ours."""
        check_layout(state_spec(state), self.layout())
        out = {s.name: np.array(state[s.name], dtype=_F, order="C") for s in self.layout()}
        if not all(np.isfinite(v).all() for v in out.values()):
            raise UpdateRejected("the global model holds NaN or Inf")
        return out

    def forward(self, params: ModelState, x: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """Logits, and the input of every Linear (what the backward pass needs)."""
        a = x * _F(2.0) - _F(1.0)
        inputs: list[np.ndarray] = []
        layers = len(self.widths) - 1
        for i in range(layers):
            inputs.append(a)
            a = a @ params[f"net.{2 * i}.weight"].T + params[f"net.{2 * i}.bias"]
            if i < layers - 1:
                a = np.maximum(a, _F(0.0))
        return a, inputs

    def backward(
        self, params: ModelState, inputs: list[np.ndarray], grad: np.ndarray
    ) -> ModelState:
        """Gradients of the loss by parameter, from the loss's gradient by logits."""
        grads: ModelState = {}
        for i in reversed(range(len(inputs))):
            a = inputs[i]
            weight = params[f"net.{2 * i}.weight"]
            grads[f"net.{2 * i}.weight"] = grad.T @ a
            grads[f"net.{2 * i}.bias"] = grad.sum(axis=0)
            if i > 0:  # through the ReLU whose output ``a`` is: torch passes where a > 0
                grad = (grad @ weight) * (a > 0)
        return grads


def cross_entropy(logits: np.ndarray, y: np.ndarray) -> tuple[np.float32, np.ndarray]:
    """Mean cross-entropy over the batch and its gradient by logits (log-softmax, stable)."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows = np.arange(len(y))
    loss = -logp[rows, y].mean(dtype=_F)
    grad = np.exp(logp)
    grad[rows, y] -= _F(1.0)
    grad /= _F(len(y))
    return _F(loss), grad


@dataclass(slots=True)
class SGD:
    """``torch.optim.SGD`` (no dampening, no Nesterov): weight decay, then momentum."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    _buffers: dict[str, np.ndarray] = field(default_factory=dict)

    def step(self, params: ModelState, grads: Mapping[str, np.ndarray]) -> None:
        for name, p in params.items():
            g = grads[name]
            if self.weight_decay:
                g = g + _F(self.weight_decay) * p
            if self.momentum:
                buf = self._buffers.get(name)
                if buf is None:
                    buf = np.array(g)  # torch's first step: the buffer is the gradient
                else:
                    buf *= _F(self.momentum)
                    buf += g
                self._buffers[name] = g = buf
            p -= _F(self.lr) * g


def batch_orders(n: int, seed: int, epochs: int) -> Iterator[np.ndarray]:
    """Each epoch's example order: ``torch.randperm(n, generator=g)`` with
    ``g = torch.Generator().manual_seed(seed)``, one generator for all epochs.

    torch seeds MT19937 with the seed's low 32 bits (``init_genrand``), as NumPy's legacy
    ``RandomState`` does (its stream is frozen by NEP 19), and shuffles with one 32-bit draw
    per position: ``swap(r[i], r[i + draw % (n - i)])``.
    """
    rng = np.random.RandomState(seed & 0xFFFFFFFF)
    for _ in range(epochs):
        draws = rng.randint(0, 2**32, size=max(n - 1, 0), dtype=np.uint64).tolist()
        order = list(range(n))
        for i, draw in enumerate(draws):
            j = i + draw % (n - i)
            order[i], order[j] = order[j], order[i]
        yield np.array(order, dtype=np.int64)


def unsupported_train(train: TrainSection) -> str | None:
    """Why this trainer cannot follow ``train`` exactly as the digits task would; or None."""
    if train.params:
        return f"the digits task has no train.params, got {sorted(train.params)}"
    checks = {
        "local_epochs": 1 <= train.local_epochs <= 10_000,
        "batch_size": train.batch_size >= 1,
        "learning_rate": 0 < train.learning_rate < float("inf"),
        "momentum": 0 <= train.momentum < 1,
        "weight_decay": 0 <= train.weight_decay < float("inf"),
        "proximal_mu": 0 <= train.proximal_mu < float("inf"),
        "update_momentum": 0 <= train.update_momentum < 1,
    }
    bad = [name for name, ok in checks.items() if not ok]
    if bad:
        return f"train.{bad[0]} = {getattr(train, bad[0])!r} is out of range"
    return None


def train_round(
    model: DigitsModel,
    state: Mapping[str, np.ndarray],
    data: tuple[Examples, Examples],
    train: TrainSection,
    seed: int,
    should_stop: StopCheck | None = None,
) -> LocalRound | Stopped:
    """One round of local training from the global ``state`` on ``(train, val)`` examples:
    the trained model and the digits task's metrics, or why it stopped early."""
    problem = unsupported_train(train)
    if problem is not None:
        raise SpecError(f"flotilla-lite cannot train this round: {problem}")
    started = time.perf_counter()
    params = model.params(state)
    fit, val = data
    trained = _fit(model, params, fit, train, seed, should_stop)
    if isinstance(trained, Stopped):
        return trained
    metrics = {**trained, COMPUTE_METRIC: time.perf_counter() - started}
    metrics.update(evaluate(model, params, val))
    return LocalRound(len(fit.y), metrics, params)


def _fit(
    model: DigitsModel,
    params: ModelState,
    data: Examples,
    train: TrainSection,
    seed: int,
    should_stop: StopCheck | None,
) -> dict[str, float] | Stopped:
    """Minibatch SGD in place on ``params``; the task's ``train_loss``/``train_accuracy``."""
    opt = SGD(train.learning_rate, train.momentum, train.weight_decay)
    mu = train.proximal_mu
    anchor = {k: v.copy() for k, v in params.items()} if mu > 0 else {}
    total_loss, correct, steps = 0.0, 0, 0
    for order in batch_orders(len(data.y), seed, train.local_epochs):
        for start in range(0, len(order), train.batch_size):
            reason = should_stop() if should_stop is not None else None
            if reason is not None:
                return Stopped(reason, steps)
            idx = order[start : start + train.batch_size]
            logits, inputs = model.forward(params, data.x[idx])
            loss, grad = cross_entropy(logits, data.y[idx])
            grads = model.backward(params, inputs, grad)
            if anchor:  # FedProx: mu/2 ||w - w_global||^2, as torch differentiates it
                loss += _F(0.5 * mu) * sum(
                    _F(((p - anchor[k]) ** 2).sum()) for k, p in params.items()
                )
                for k, p in params.items():
                    grads[k] += _F(0.5 * mu) * (_F(2.0) * (p - anchor[k]))
            opt.step(params, grads)
            total_loss += float(loss) * len(idx)
            correct += int((logits.argmax(axis=1) == data.y[idx]).sum())
            steps += 1
    seen = max(len(data.y) * train.local_epochs, 1)
    return {"train_loss": total_loss / seen, "train_accuracy": correct / seen}


def evaluate(model: DigitsModel, params: ModelState, data: Examples) -> dict[str, float]:
    """The task's ``evaluate``: accuracy, mean cross-entropy and the example count."""
    if not len(data.y):
        return {"accuracy": 0.0, "loss": 0.0, "num_samples": 0.0}
    logits, _ = model.forward(params, data.x)
    loss, _ = cross_entropy(logits, data.y)
    accuracy = float((logits.argmax(axis=1) == data.y).mean())
    return {"accuracy": accuracy, "loss": float(loss), "num_samples": float(len(data.y))}
