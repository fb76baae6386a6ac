"""An update from one device for one round, after it has been decoded and checked."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from flotilla.core.tensors import ModelState

#: Update metrics the scheduler learns from: seconds the device spent training (the rest
#: of its round was transfer), and its training loss (Oort's statistical utility).
COMPUTE_METRIC = "compute_s"
LOSS_METRIC = "train_loss"


@dataclass(frozen=True, slots=True)
class Update:
    """A device's contribution to a round: the change it proposes to the global model."""

    job_id: str
    round: int
    device_id: str
    num_samples: int
    #: Local model minus the round's global model, per tensor.
    delta: ModelState
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LocalRound:
    """What a device's task returns after one round of local training, before it travels."""

    num_samples: int
    metrics: dict[str, float]
    #: The trained model, whole (the client takes the delta from the global model).
    state: ModelState
    #: Training samples the device's data for the task holds, counted when it loaded (the
    #: device reports them in its profile); None where the task cannot tell.
    samples_held: int | None = None
