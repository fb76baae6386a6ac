"""What a device says about its state at each poll: battery, power, network, idleness, heat.

Production federated learning trains only on idle, charging devices on unmetered networks
(Bonawitz et al., 2019). Every edge parses the same JSON object with the same strict rules,
so an HTTP device, a gRPC agent and a conditions file can never disagree on a field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flotilla.core.errors import WireError

NETWORKS = ("unmetered", "metered", "unknown")
THERMAL_STATES = ("nominal", "fair", "serious", "critical", "unknown")
_FIELDS = ("charging", "battery", "network", "idle", "thermal")


@dataclass(frozen=True, slots=True)
class DeviceConditions:
    """None (or "unknown") means the device cannot tell; policies decide what that allows."""

    charging: bool | None = None
    battery: float | None = None  # 0.0 (empty) .. 1.0 (full)
    network: str = "unknown"
    idle: bool | None = None
    thermal: str = "unknown"

    def __post_init__(self) -> None:
        if self.battery is not None and not (
            math.isfinite(self.battery) and 0.0 <= self.battery <= 1.0
        ):
            raise WireError(f"device conditions: battery must be within 0..1, got {self.battery}")
        if self.network not in NETWORKS:
            raise WireError(
                f"device conditions: network must be one of {', '.join(NETWORKS)}, "
                f"got {self.network!r}"
            )
        if self.thermal not in THERMAL_STATES:
            raise WireError(
                f"device conditions: thermal must be one of {', '.join(THERMAL_STATES)}, "
                f"got {self.thermal!r}"
            )

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], where: str = "device conditions"
    ) -> DeviceConditions:
        """Parse a JSON object; unknown fields and wrong types are refused by name."""
        if not isinstance(data, Mapping):
            raise WireError(f"{where}: expected a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise WireError(f"{where}: unknown field(s) {', '.join(unknown)}")
        charging = _optional_bool(data, "charging", where)
        idle = _optional_bool(data, "idle", where)
        battery = data.get("battery")
        if battery is not None and (
            isinstance(battery, bool) or not isinstance(battery, (int, float))
        ):
            raise WireError(f"{where}: battery must be a number or null")
        if isinstance(battery, int) and not 0 <= battery <= 1:  # before float(): 10**400
            raise WireError(f"{where}: battery must be within 0..1, got {str(battery)[:20]}")
        network = data.get("network", "unknown")
        thermal = data.get("thermal", "unknown")
        for name, value in (("network", network), ("thermal", thermal)):
            if not isinstance(value, str):
                raise WireError(f"{where}: {name} must be a string")
        try:
            return cls(
                charging=charging,
                battery=None if battery is None else float(battery),
                network=network,
                idle=idle,
                thermal=thermal,
            )
        except WireError as exc:
            raise WireError(str(exc).replace("device conditions", where, 1)) from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "charging": self.charging,
            "battery": self.battery,
            "network": self.network,
            "idle": self.idle,
            "thermal": self.thermal,
        }


def _optional_bool(data: Mapping[str, Any], name: str, where: str) -> bool | None:
    value = data.get(name)
    if value is not None and not isinstance(value, bool):
        raise WireError(f"{where}: {name} must be true, false or null")
    return value
