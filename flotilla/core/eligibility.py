"""Which devices a job may select: its ``[eligibility]`` policy, judged in one pure function.

The server applies it at selection and again when a device's conditions change mid-round;
devices apply the same function to stop training the moment they stop qualifying. One
function on both sides, so a device and the server never disagree about why.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from flotilla.core.conditions import DeviceConditions
from flotilla.core.device import DeviceProfile
from flotilla.core.errors import SpecError
from flotilla.core.tables import build_dataclass


@dataclasses.dataclass(frozen=True, slots=True)
class EligibilitySection:
    """A job's ``[eligibility]``. Conditions a device cannot report (unknown) never qualify."""

    require_charging: bool = False
    require_unmetered: bool = False
    require_idle: bool = False
    #: Lowest battery level, 0..1; 0 accepts any (and an unknown level).
    min_battery: float = 0.0
    #: Device classes the job may use (``DeviceProfile.device_class``); empty: any.
    device_classes: tuple[str, ...] = ()
    #: Lowest measured speed and memory (the profile's ``gflops`` and ``memory_bytes``).
    min_gflops: float = 0.0
    min_memory_bytes: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.min_battery) and 0.0 <= self.min_battery <= 1.0):
            raise SpecError(f"eligibility.min_battery must be within 0..1, got {self.min_battery}")
        if not (math.isfinite(self.min_gflops) and self.min_gflops >= 0):
            raise SpecError(f"eligibility.min_gflops must be >= 0, got {self.min_gflops}")
        if self.min_memory_bytes < 0:
            raise SpecError(
                f"eligibility.min_memory_bytes must be >= 0, got {self.min_memory_bytes}"
            )

    @property
    def needs_conditions(self) -> bool:
        """Whether a change in the device's conditions can end its eligibility mid-round."""
        return (
            self.require_charging
            or self.require_unmetered
            or self.require_idle
            or self.min_battery > 0
        )

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["device_classes"] = list(self.device_classes)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EligibilitySection:
        """The policy as a task's config carries it (what ``to_dict`` wrote)."""
        return build_dataclass(cls, data, "eligibility", "eligibility.")


def ineligibility(
    policy: EligibilitySection, profile: DeviceProfile | None, conditions: DeviceConditions | None
) -> str | None:
    """Why the device may not work for a job under ``policy``; None when it may."""
    reason = _conditions_reason(policy, conditions or DeviceConditions())
    if reason is not None:
        return reason
    if profile is None:
        return None
    if policy.device_classes and profile.device_class not in policy.device_classes:
        wanted = ", ".join(policy.device_classes)
        return f"device class {profile.device_class or 'unset'!r} is not one of {wanted}"
    if profile.gflops < policy.min_gflops:
        return f"measured {profile.gflops:.3g} GFLOP/s, below min_gflops {policy.min_gflops:.3g}"
    if profile.memory_bytes < policy.min_memory_bytes:
        floor = policy.min_memory_bytes
        return f"{profile.memory_bytes} bytes of memory, below min_memory_bytes {floor}"
    return None


def _conditions_reason(policy: EligibilitySection, c: DeviceConditions) -> str | None:
    if policy.require_charging and c.charging is not True:
        return "not charging" if c.charging is False else "charging unknown"
    if policy.require_unmetered and c.network != "unmetered":
        return f"network {c.network}, unmetered required"
    if policy.require_idle and c.idle is not True:
        return "not idle" if c.idle is False else "idleness unknown"
    if policy.min_battery > 0:
        if c.battery is None:
            return "battery level unknown"
        if c.battery < policy.min_battery:
            return f"battery {c.battery:.0%}, below min_battery {policy.min_battery:.0%}"
    return None
