"""One round on a light device: a work order and the model's bytes in, the upload out.

What a gRPC agent's ``LocalTrainer`` does with torch, here in NumPy: decode the broadcast,
train the digits MLP, take the delta from the global model, smooth it with the job's
update momentum, encode it with the round's uplink codec (with error feedback when the job
asks). Before any of that, :meth:`LiteTrainer.unsupported` says why this device cannot do
a round exactly as asked, so the device reports that reason instead of sending garbage.

The local training itself is a :class:`LocalTraining`: :class:`MlpTraining` (the NumPy MLP)
by default, or ``flotilla.mobile.program.ProgramTraining`` (an exported ExecuTorch program,
``flotilla-lite --program``); everything around it is the same for both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from flotilla.core.blobs import sha256_hex
from flotilla.core.device import MAX_SAMPLES
from flotilla.core.errors import FlotillaError, SpecError, WireError
from flotilla.core.round_config import RoundConfig
from flotilla.core.spec import TrainSection
from flotilla.core.tensors import ModelState, TensorSpec, decode_state
from flotilla.core.update import LocalRound
from flotilla.core.work import WorkOrder
from flotilla.mobile.lite.codecs import LiteCodec, decode_payload, encode_update
from flotilla.mobile.lite.data import ShardFile
from flotilla.mobile.lite.mlp import (
    CLASSES,
    INPUTS,
    TASKS,
    DigitsModel,
    Examples,
    StopCheck,
    Stopped,
    train_round,
    unsupported_train,
)

#: Kinds of per-job state a device keeps between rounds.
MOMENTUM, RESIDUALS = "momentum", "residuals"
_HEADER_SLACK = 1 << 20


class JobStates(Protocol):
    """Per-job tensors kept from one round to the next (momentum, error-feedback residuals)."""

    def get(self, kind: str, job_id: str) -> ModelState | None: ...

    def put(self, kind: str, job_id: str, state: ModelState) -> None: ...


@dataclass(slots=True)
class MemoryJobStates:
    """Job states for this process only (tests; the state dir keeps them across restarts)."""

    _states: dict[tuple[str, str], ModelState] = field(default_factory=dict)

    def get(self, kind: str, job_id: str) -> ModelState | None:
        return self._states.get((kind, job_id))

    def put(self, kind: str, job_id: str, state: ModelState) -> None:
        self._states[(kind, job_id)] = dict(state)


class LocalTraining(Protocol):
    """How a device trains one round from the global model (the part a phone SDK swaps)."""

    #: The task entry points this training can do (what the device tells the server).
    @property
    def tasks(self) -> tuple[str, ...]: ...

    def layout(self, task: str, train: TrainSection) -> tuple[TensorSpec, ...]:
        """``task``'s tensors as they travel; a FlotillaError that says why this device
        cannot train ``task`` with ``train`` exactly as a torch agent would."""
        ...

    def fit(
        self,
        task: str,
        state: ModelState,
        data: tuple[Examples, Examples],
        train: TrainSection,
        seed: int,
        should_stop: StopCheck | None,
    ) -> LocalRound | Stopped:
        """One round on ``(train, val)`` examples from the global ``state`` (laid out as
        :meth:`layout` says), batches in :func:`~flotilla.mobile.lite.mlp.batch_orders`."""
        ...


@dataclass(frozen=True, slots=True)
class MlpTraining:
    """The digits MLP in NumPy (:mod:`flotilla.mobile.lite.mlp`)."""

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(TASKS)

    def layout(self, task: str, train: TrainSection) -> tuple[TensorSpec, ...]:
        model = DigitsModel.for_task(task)
        problem = unsupported_train(train)
        if problem is not None:
            raise SpecError(problem)
        return model.layout()

    def fit(
        self,
        task: str,
        state: ModelState,
        data: tuple[Examples, Examples],
        train: TrainSection,
        seed: int,
        should_stop: StopCheck | None,
    ) -> LocalRound | Stopped:
        return train_round(DigitsModel.for_task(task), state, data, train, seed, should_stop)


@dataclass(frozen=True, slots=True)
class LiteUpdate:
    """What the device uploads for a round, and the upload header's fields."""

    num_samples: int
    metrics: dict[str, float]
    payload: bytes
    payload_sha256: str
    #: The codec that wrote ``payload`` (the header's ``codec``).
    codec: str
    #: Secure rounds: the update itself, masked instead of uploaded (``payload`` empty).
    delta: ModelState | None = None


def round_codec(order: WorkOrder, config: RoundConfig) -> LiteCodec:
    """The uplink codec for this round: the device's own (``order.uplink_codec``, with its
    default parameters) or the job's, with the job's parameters."""
    spec = config.compression
    name = order.uplink_codec or spec.uplink
    return LiteCodec.make(name, spec.uplink_params if name == spec.uplink else {})


class LiteTrainer:
    """Trains rounds of a digits job on this device's shard file."""

    def __init__(
        self,
        data: ShardFile,
        states: JobStates | None = None,
        training: LocalTraining | None = None,
    ) -> None:
        """SpecError when ``data`` is not digits (64 pixels in [0, 1], labels 0..9)."""
        _check_digits(data)
        self.data = data
        self.states: JobStates = states if states is not None else MemoryJobStates()
        self.training: LocalTraining = training if training is not None else MlpTraining()
        self._examples = (Examples(data.x_train, data.y_train), Examples(data.x_val, data.y_val))

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks this device trains."""
        return self.training.tasks

    @property
    def samples(self) -> dict[str, int]:
        """Training samples it holds per task: every task trains on the one data file."""
        return {task: min(len(self.data.y_train), MAX_SAMPLES) for task in self.tasks}

    def unsupported(self, order: WorkOrder) -> str | None:
        """Why this device cannot do ``order``'s round exactly as a torch agent would."""
        try:
            self._plan(order)
        except FlotillaError as exc:
            return str(exc)
        return None

    def _plan(self, order: WorkOrder) -> tuple[tuple[TensorSpec, ...], RoundConfig, LiteCodec]:
        config = RoundConfig.from_json(order.config_json)
        if config.p2p is not None:
            raise SpecError("server-less (p2p) rounds need a peer-to-peer device (the p2p extra)")
        layout = self.training.layout(order.task, config.train)
        codec = round_codec(order, config)
        spec = config.compression
        if spec.downlink != "none" and not spec.downlink_delta:
            LiteCodec.make(spec.downlink, spec.downlink_params)
            if config.layout != layout:
                raise WireError("a compressed broadcast needs the model's layout in the task")
        raw = json.loads(order.config_json)
        if raw.get("eligibility") is not None:
            from flotilla.core.eligibility import EligibilitySection

            EligibilitySection.from_dict(raw["eligibility"])
        return layout, config, codec

    def train(
        self,
        order: WorkOrder,
        model_bytes: bytes | bytearray | memoryview,
        should_stop: StopCheck | None = None,
    ) -> LiteUpdate | Stopped:
        """Train ``order``'s round from the broadcast ``model_bytes`` (already checked
        against the order's SHA-256); Stopped when ``should_stop`` gives a reason.
        FlotillaError (SpecError, TaskLoadError, WireError) for what :meth:`unsupported`
        names, and WireError or UpdateRejected for a broadcast that is not the model."""
        layout, config, codec = self._plan(order)
        global_state = _decode_model(layout, config, model_bytes)
        trained = self.training.fit(
            order.task, global_state, self._examples, config.train, int(order.seed), should_stop
        )
        if isinstance(trained, Stopped):
            return trained
        delta = {k: trained.state[k] - global_state[k] for k in global_state}
        delta = self._smooth(order.job_id, delta, config.train.update_momentum)
        if config.secagg is not None:  # SecAgg+ quantizes it; no codec, no residuals
            return LiteUpdate(trained.num_samples, trained.metrics, b"", "", "none", delta)
        residuals = None
        if config.compression.error_feedback:
            residuals = _matching(self.states.get(RESIDUALS, order.job_id), delta)
        payload, kept = encode_update(codec, delta, residuals)
        if kept is not None:
            self.states.put(RESIDUALS, order.job_id, kept)
        return LiteUpdate(
            trained.num_samples, trained.metrics, payload, sha256_hex(payload), codec.name
        )

    def _smooth(self, job_id: str, delta: ModelState, beta: float) -> ModelState:
        """Update momentum ``m = beta*m + (1-beta)*delta``, kept per job across rounds."""
        if beta <= 0:
            return delta
        held = _matching(self.states.get(MOMENTUM, job_id), delta)
        out: ModelState = {}
        for name, value in delta.items():
            old = held.get(name)
            m = (1.0 - beta) * value if old is None else beta * old + (1 - beta) * value
            out[name] = np.asarray(m, dtype=np.float32)
        self.states.put(MOMENTUM, job_id, out)
        return out


def _decode_model(
    layout: tuple[TensorSpec, ...], config: RoundConfig, payload: bytes | bytearray | memoryview
) -> ModelState:
    """The broadcast: plain safetensors, or the job's downlink codec payload."""
    spec = config.compression
    if spec.downlink == "none" or spec.downlink_delta:  # whole models travel plain then
        limit = sum(s.nbytes for s in layout) + _HEADER_SLACK
        return decode_state(payload, layout, limit)
    return decode_payload(payload, LiteCodec.make(spec.downlink, spec.downlink_params), layout)


def _matching(held: Mapping[str, np.ndarray] | None, like: ModelState) -> ModelState:
    """The held tensors that still fit ``like``'s layout (others are dropped)."""
    if not held:
        return {}
    return {k: v for k, v in held.items() if k in like and v.shape == like[k].shape}


def _check_digits(data: ShardFile) -> None:
    """The digits task's examples: 64 pixels in [0, 1], labels 0..9."""
    for x, y, part in ((data.x_train, data.y_train, "train"), (data.x_val, data.y_val, "val")):
        if x.ndim != 2 or x.shape[1] != INPUTS:
            raise SpecError(f"x_{part} must be (N, {INPUTS}) for the digits task, got {x.shape}")
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= CLASSES):
            raise SpecError(f"y_{part} labels must be within 0..{CLASSES - 1}")
        if x.size and (float(x.min()) < 0.0 or float(x.max()) > 1.0):
            raise SpecError(f"x_{part} pixels must be within [0, 1]")
