"""The seam between the round engine and whatever runs the training: real or virtual devices."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from flotilla.aggregation import PartialSum
from flotilla.compression import Codec, NoneCodec
from flotilla.core.allreduce import Contribution
from flotilla.core.eligibility import EligibilitySection
from flotilla.core.tensors import TensorSpec
from flotilla.core.update import Update
from flotilla.core.work import WorkOrder


class SecureExchange(Protocol):
    """A secure round's stage messages (``engine.stages.StageExchange``): the backend
    hands each device's message in and the device's next one back."""

    async def exchange(self, device_id: str, stage: int, body: bytes) -> bytes:
        """Waits (bounded) until the stage closes; errors of ``flotilla.core.errors``."""
        ...


@dataclass(frozen=True, slots=True)
class FoldSpec:
    """A round whose updates a backend may fold where they are trained (a simulation's
    workers): the job's linear strategy, rebuilt there to ``add`` each update as the
    server would, and how many updates the round takes (its ``clients_per_round``)."""

    strategy: str
    #: The strategy's parameters, as JSON (they travel to worker processes).
    params_json: str
    want: int


@dataclass(frozen=True, slots=True)
class TrainTask:
    """One round's work for every device selected for it: the order a device receives, and
    what the server checks updates against. Only the uplink codec may differ per device
    (``device_codecs``); :meth:`for_device` is one device's own task."""

    order: WorkOrder
    #: What every update must look like: the model's tensor names, dtypes and shapes.
    layout: tuple[TensorSpec, ...] = ()
    #: The job's uplink codec: updates arrive in its payload format.
    codec: Codec = field(default_factory=NoneCodec)
    #: ``p2p``: the devices all-reduce among themselves and report (see engine.p2p_round).
    transport: str = "server"
    #: The job's ``[eligibility]`` when a change in a device's conditions can end its part
    #: in the round (the server checks what heartbeats and polls carry); None: it cannot.
    policy: EligibilitySection | None = None
    #: Device -> its uplink codec, chosen by measured uplink (``uplink_by_mbps``); a
    #: device not named here uses ``codec``.
    device_codecs: Mapping[str, Codec] = field(default_factory=dict)
    #: Secure rounds: where the devices' stage messages go instead of uploads.
    secagg: SecureExchange | None = None
    #: Set when the backend may hand the round's updates over pre-folded (:class:`Folded`).
    fold: FoldSpec | None = None

    def codec_for(self, device_id: str) -> Codec:
        """The codec ``device_id``'s update must arrive in."""
        return self.device_codecs.get(device_id, self.codec)

    def for_device(self, device_id: str) -> TrainTask:
        """This task as ``device_id`` receives it: its order names its uplink codec."""
        codec = self.device_codecs.get(device_id)
        if codec is None:
            return self
        order = dataclasses.replace(self.order, uplink_codec=codec.name)
        return dataclasses.replace(self, order=order, codec=codec, device_codecs={})


def _accept_silently(reason: str | None) -> None:
    """Default settle hook for backends whose senders need no answer."""


def _always() -> bool:
    return True


@dataclass(frozen=True, slots=True)
class Delivered:
    """A decoded, well-formed update. ``settle(None)`` accepts it, ``settle(why)`` refuses it."""

    update: Update
    #: Seconds from dispatch to arrival.
    elapsed_s: float
    settle: Callable[[str | None], None] = _accept_silently
    #: False once the sender stopped waiting for a verdict (it timed out or hung up). Such
    #: an update must not be folded: its device may already be serving another job.
    wanted: Callable[[], bool] = _always


@dataclass(frozen=True, slots=True)
class Failed:
    """A selected device that will deliver nothing for this round."""

    device_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Reported:
    """A device's account of a server-less round: the model its all-reduce group agreed on."""

    device_id: str
    #: Seconds from dispatch to the report.
    elapsed_s: float
    #: SHA-256 of the next model as this device built it (base + the group's average).
    model_sha256: str
    group_id: str
    #: Every member of the group, as the all-reduce named them.
    contributors: tuple[Contribution, ...]
    allreduce_s: float = 0.0
    #: Incomplete attempts the all-reduce reverted before the one it committed.
    reverted: int = 0


@dataclass(frozen=True, slots=True)
class Arrival:
    """One device's accepted update, without the update: who, its samples and metrics,
    and when it arrived (the members of a :class:`Folded` result)."""

    device_id: str
    num_samples: int
    metrics: Mapping[str, float]
    #: Seconds from dispatch to this device's arrival.
    elapsed_s: float


@dataclass(frozen=True, slots=True)
class Folded:
    """Updates folded where they were trained (a task with a :class:`FoldSpec`), handed
    over when the last of them arrives: their sum and who it holds, in arrival order.
    The backend hands over only updates the round takes: no more than it still wants,
    each checked by the strategy's ``add`` (one it refused comes as :class:`Failed`)."""

    round: int
    partial: PartialSum
    members: tuple[Arrival, ...]


RoundResult = Delivered | Failed | Reported | Folded


def senders(result: RoundResult) -> tuple[str, ...]:
    """The devices a result speaks for."""
    if isinstance(result, Delivered):
        return (result.update.device_id,)
    if isinstance(result, Folded):
        return tuple(m.device_id for m in result.members)
    return (result.device_id,)


class ResultStream(Protocol):
    """A round's results as they arrive; closing it closes the round."""

    def __aiter__(self) -> AsyncIterator[RoundResult]: ...

    async def __anext__(self) -> RoundResult: ...

    async def aclose(self) -> None: ...


class Backend(Protocol):
    """Runs a round's task on devices and streams back their results as they arrive.

    ``dispatch`` is only ever called from inside :meth:`flotilla.scheduling.Leases.dispatch`,
    which claims the devices in the same call, so a backend may treat a claimed device it
    has no task for as free. The engine stops iterating when it has enough updates or the
    deadline passes, then closes the stream; from then on the backend must refuse the
    round's late updates. A backend never frees a device: it reports it to the lease owner
    (:class:`flotilla.scheduling.DeviceEvents`).
    """

    def dispatch(self, task: TrainTask, device_ids: Sequence[str]) -> ResultStream: ...
