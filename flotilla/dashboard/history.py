"""Device counts over time: the ring buffer behind ``/api/v1/devices/history`` (the
dashboard's online/idle/busy chart), fed by the read app from whatever source it serves."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from flotilla.dashboard.model import DeviceStatus


@dataclass(frozen=True, slots=True)
class DeviceSample:
    """How many devices were in each state at unix time ``t``."""

    t: float
    idle: int
    busy: int
    offline: int


def count(t: float, devices: Sequence[DeviceStatus]) -> DeviceSample:
    """One sample of ``devices``; an ``ineligible`` device is online and not busy: idle."""
    busy = sum(d.state == "busy" for d in devices)
    offline = sum(d.state == "offline" for d in devices)
    return DeviceSample(t, len(devices) - busy - offline, busy, offline)


class DeviceCountHistory:
    """The last ``capacity`` samples, at most one per ``min_interval_s`` (a burst of
    device changes, as a fleet joins, replaces the latest sample instead of flooding)."""

    def __init__(self, capacity: int = 720, min_interval_s: float = 1.0) -> None:
        self._samples: deque[DeviceSample] = deque(maxlen=capacity)
        self._min_interval_s = min_interval_s

    def record(self, sample: DeviceSample) -> None:
        last = self._samples[-1] if self._samples else None
        if last is not None and sample.t - last.t < self._min_interval_s:
            self._samples[-1] = DeviceSample(last.t, sample.idle, sample.busy, sample.offline)
        else:
            self._samples.append(sample)

    def samples(self) -> tuple[DeviceSample, ...]:
        """Oldest first."""
        return tuple(self._samples)
