"""The fleet as the scheduler sees it: who is online, idle, and able to run which task."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from flotilla.core.device import DeviceProfile
from flotilla.scheduling.history import FleetHistory, RoundOutcome


@dataclass(slots=True)
class DeviceState:
    profile: DeviceProfile
    last_seen: float
    online: bool = True
    #: The job this device is serving, or None when idle.
    busy_with: str | None = None


@dataclass(frozen=True, slots=True)
class DeviceView:
    """One device as an operator sees it."""

    device_id: str
    #: ``offline``, ``idle``, ``busy`` or ``ineligible``.
    state: str
    job_id: str = ""
    reason: str = ""
    last_seen: float = 0.0


@dataclass(slots=True)
class DevicePool:
    """Online devices and their occupancy; a device serves one job at a time.

    Single-threaded by design (one asyncio loop owns it), so ``claim`` is atomic.
    """

    clock: Callable[[], float]
    _devices: dict[str, DeviceState] = field(default_factory=dict)
    #: What each device did for each job: what selectors learn from.
    history: FleetHistory = field(default_factory=FleetHistory)

    def record(self, outcome: RoundOutcome) -> None:
        """A closed round's evidence, for every selector of every job."""
        self.history.record(outcome)

    def profile(self, device_id: str) -> DeviceProfile | None:
        state = self._devices.get(device_id)
        return None if state is None else state.profile

    def seen(self, profile: DeviceProfile) -> None:
        """Record a sign of life, adding the device or refreshing its profile."""
        state = self._devices.get(profile.device_id)
        if state is None:
            self._devices[profile.device_id] = DeviceState(profile, self.clock())
        else:
            state.profile = profile
            state.last_seen = self.clock()
            state.online = True

    def touch(self, device_id: str) -> None:
        state = self._devices.get(device_id)
        if state is not None:
            state.last_seen = self.clock()
            state.online = True

    def leave(self, device_id: str) -> None:
        """Mark the device offline; its job lets go through :class:`~.leases.Leases`."""
        state = self._devices.get(device_id)
        if state is not None:
            state.online = False

    def expire(self, liveness_s: float) -> list[str]:
        """Mark devices silent for longer than ``liveness_s`` offline.

        A silent device keeps its job: an update it already delivered may still be waiting
        to be folded, and a device that speaks again must not be claimed by a second job
        meanwhile. Its job releases it (or it frees itself by polling again).
        """
        now = self.clock()
        gone = [d for d, s in self._devices.items() if s.online and now - s.last_seen > liveness_s]
        for device_id in gone:
            self._devices[device_id].online = False
        return gone

    def idle(self, task: str) -> list[DeviceProfile]:
        """Online, idle devices that have ``task`` installed, in a stable order."""
        return [
            s.profile
            for _, s in sorted(self._devices.items())
            if s.online and s.busy_with is None and task in s.profile.tasks
        ]

    def eligible(self, task: str) -> list[DeviceProfile]:
        """Online devices that have ``task`` installed, busy or not: the population a
        round samples from (its size is the denominator of the sampling rate)."""
        return [
            s.profile
            for _, s in sorted(self._devices.items())
            if s.online and task in s.profile.tasks
        ]

    def claim(self, device_ids: list[str], job_id: str) -> None:
        """Mark the devices busy with ``job_id``, all or none. Only ``Leases`` calls this."""
        for device_id in device_ids:
            state = self._devices[device_id]
            if state.busy_with is not None or not state.online:
                raise RuntimeError(f"device {device_id} is not idle")
        for device_id in device_ids:
            self._devices[device_id].busy_with = job_id

    def release(self, device_id: str, job_id: str) -> None:
        """Free the device if ``job_id`` holds it. Only ``Leases`` calls this."""
        state = self._devices.get(device_id)
        if state is not None and state.busy_with == job_id:
            state.busy_with = None

    def busy_with(self, device_id: str) -> str | None:
        state = self._devices.get(device_id)
        return None if state is None else state.busy_with

    def is_online(self, device_id: str) -> bool:
        state = self._devices.get(device_id)
        return state is not None and state.online

    def describe(self, task: str = "") -> list[DeviceView]:
        """Every device the pool has seen, in id order; with ``task``, those lacking it are
        ``ineligible`` (busy and offline say so first)."""
        out = []
        for device_id, s in sorted(self._devices.items()):
            if not s.online:
                view = DeviceView(device_id, "offline", last_seen=s.last_seen)
            elif s.busy_with is not None:
                view = DeviceView(device_id, "busy", s.busy_with, last_seen=s.last_seen)
            elif task and task not in s.profile.tasks:
                reason = f"task {task} is not installed"
                view = DeviceView(device_id, "ineligible", reason=reason, last_seen=s.last_seen)
            else:
                view = DeviceView(device_id, "idle", last_seen=s.last_seen)
            out.append(view)
        return out

    def __len__(self) -> int:
        return sum(1 for s in self._devices.values() if s.online)
