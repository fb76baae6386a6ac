"""What the server sends with each training task, parsed and checked.

The engine writes a job's ``train``, ``data`` and ``compression`` sections (and, when the
device needs them, the model's layout and a server-less round's group plan) as JSON in the
task; devices and simulated devices read it back with :meth:`RoundConfig.from_json`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flotilla.core.allreduce import GroupPlan
from flotilla.core.eligibility import EligibilitySection
from flotilla.core.errors import SpecError, WireError
from flotilla.core.spec import CompressionSection, DataSection, PrivacySection, TrainSection
from flotilla.core.tables import build_dataclass
from flotilla.core.tensors import TensorSpec

#: How a secure round weights each device's update: by its sample count (FedAvg and
#: friends) or all alike (DP-FedAvg, which is unweighted).
WEIGHTINGS = ("samples", "one")
#: The most participants a secure round names (the task config stays small).
MAX_PARTICIPANTS = 10_000


@dataclass(frozen=True, slots=True)
class SecurePlan:
    """A secure round (SecAgg+) as its devices are told: the job's ``[privacy]`` section,
    who is in the round (server order, which seeds the ring every party computes), how
    to weight the update, and the L2 norm to clip it to first (DP-FedAvg's clip; 0: none)."""

    privacy: PrivacySection
    participants: tuple[str, ...]
    weighting: str = "samples"
    l2_clip: float = 0.0

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise SpecError(f"secagg.weighting must be one of {', '.join(WEIGHTINGS)}")
        if not 0 < len(self.participants) <= MAX_PARTICIPANTS:
            raise SpecError(f"secagg.participants must name 1 to {MAX_PARTICIPANTS} devices")
        if len(set(self.participants)) != len(self.participants):
            raise SpecError("secagg.participants names a device twice")
        if not (self.l2_clip >= 0 and self.l2_clip < float("inf")):
            raise SpecError(f"secagg.l2_clip must be finite and >= 0, got {self.l2_clip!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "privacy": dataclasses.asdict(self.privacy),
            "participants": list(self.participants),
            "weighting": self.weighting,
            "l2_clip": self.l2_clip,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> SecurePlan:
        """WireError (naming the field) on anything malformed."""
        where = "task config"
        try:
            privacy = build_dataclass(PrivacySection, raw["privacy"], where, "secagg.privacy.")
            participants = tuple(str(d) for d in raw["participants"])
            return cls(privacy, participants, str(raw["weighting"]), float(raw["l2_clip"]))
        except (KeyError, TypeError, ValueError, SpecError) as exc:
            raise WireError(f"{where}: secagg is malformed: {exc}") from exc


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
    #: Secure rounds: the device masks its update with SecAgg+ instead of uploading it.
    secagg: SecurePlan | None = None

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
        secagg = raw.get("secagg")
        if secagg is not None and not isinstance(secagg, dict):
            raise WireError(f"{where}: secagg must be a table")
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
            None if secagg is None else SecurePlan.from_dict(secagg),
        )
