"""What the server knows about a device's capacity."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """Measured by the agent at enrolment; selectors use it to predict round times."""

    device_id: str
    tasks: tuple[str, ...] = ()
    gflops: float = 0.0
    memory_bytes: int = 0
    upload_bytes_per_s: float = 0.0
    #: What kind of device it says it is (``phone``, ``sbc``, ``laptop``, ``gpu``...); jobs
    #: may restrict selection to some classes (``[eligibility] device_classes``).
    device_class: str = ""
    #: Training samples the device holds, per task (import path ``module:Class``); a task it
    #: has not counted is absent. Selectors weigh data by it (docs/scheduling.md).
    samples: Mapping[str, int] = field(default_factory=dict)
    extra: Mapping[str, float] = field(default_factory=dict)

    def numbers(self) -> dict[str, float]:
        """The measured numbers as a flat mapping, for storage and selectors."""
        out = {k: float(v) for k, v in asdict(self).items() if isinstance(v, (int, float))}
        out.update({k: float(v) for k, v in self.extra.items()})
        return out
