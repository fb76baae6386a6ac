"""What the server knows about a device's capacity, and the one rule its sample counts obey."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from flotilla.core.errors import WireError

#: Sample counts a device may report: at most this many tasks, each count 0..MAX_SAMPLES,
#: each task named like the tasks it announces (1 to MAX_TASK_NAME characters).
MAX_SAMPLE_TASKS = 64
MAX_SAMPLES = 10**9
MAX_TASK_NAME = 256


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


def sample_counts(value: object, where: str = "profile") -> dict[str, int]:
    """``value`` as a device's per-task sample counts, or a WireError naming ``samples``.

    Both edges parse with it and the server's core checks every profile with it, so a
    device on either edge is held to the same rule and a refused profile stores nothing.
    """
    field_name = f"{where}: 'samples'"
    if not isinstance(value, Mapping):
        raise WireError(f"{field_name} must map task names to sample counts")
    if len(value) > MAX_SAMPLE_TASKS:
        raise WireError(f"{field_name} holds {len(value)} tasks; at most {MAX_SAMPLE_TASKS}")
    out: dict[str, int] = {}
    for task, count in value.items():
        if not isinstance(task, str) or not 0 < len(task) <= MAX_TASK_NAME:
            raise WireError(f"{field_name}: task names must be 1 to {MAX_TASK_NAME} characters")
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_SAMPLES:
            raise WireError(
                f"{field_name}: the count of {task!r} must be an integer from 0 to "
                f"{MAX_SAMPLES}, got {_shown(count)}"
            )
        out[task] = count
    return out


def _shown(value: object) -> str:
    """A refused count, short: a JSON integer may have thousands of digits."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**20:
        return "a number of more than 20 digits"
    text = repr(value) if isinstance(value, (bool, int, float)) else type(value).__name__
    return text if len(text) <= 24 else text[:21] + "..."
