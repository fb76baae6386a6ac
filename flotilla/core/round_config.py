"""What the server sends with each training task, parsed and checked.

The engine writes a job's ``train``, ``data`` and ``compression`` sections (and, when the
device needs them, the model's layout and a server-less round's group plan) as JSON in the
task; devices and simulated devices read it back with :meth:`RoundConfig.from_json`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from flotilla.core.allreduce import GroupPlan
from flotilla.core.eligibility import EligibilitySection
from flotilla.core.errors import SpecError, WireError
from flotilla.core.spec import CompressionSection, DataSection, TrainSection
from flotilla.core.tables import build_dataclass
from flotilla.core.tensors import TensorSpec


@dataclass(frozen=True, slots=True)
class RoundConfig:
    """What the server sends with a task, parsed and checked."""

    train: TrainSection
    data: DataSection
    compression: CompressionSection
    #: The model's layout; sent when the broadcast is a codec payload, which needs it.
    layout: tuple[TensorSpec, ...] | None = None
    #: Server-less rounds: how this round's devices all-reduce their updates.
    p2p: GroupPlan | None = None
    #: The job's ``[eligibility]``: a device stops a round when it no longer qualifies.
    eligibility: EligibilitySection = field(default_factory=EligibilitySection)

    @classmethod
    def from_json(cls, text: str) -> RoundConfig:
        """WireError (naming the field) on anything malformed."""
        where = "task config"
        try:
            raw = json.loads(text)
            layout = raw.get("layout")
            specs = None
            if layout is not None:
                specs = tuple(
                    TensorSpec(str(n), str(d), tuple(int(x) for x in s)) for n, d, s in layout
                )
        except (ValueError, TypeError, AttributeError) as exc:
            raise WireError(f"{where} is malformed: {exc}") from exc
        p2p = raw.get("p2p")
        try:
            eligibility = EligibilitySection.from_dict(raw.get("eligibility", {}))
        except SpecError as exc:
            raise WireError(f"{where}: {exc}") from exc
        return cls(
            build_dataclass(TrainSection, raw.get("train", {}), where, "train."),
            build_dataclass(DataSection, raw.get("data", {}), where, "data."),
            build_dataclass(CompressionSection, raw.get("compression", {}), where, "compression."),
            specs,
            None if p2p is None else GroupPlan.from_dict(p2p),
            eligibility,
        )
