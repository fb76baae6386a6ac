"""The fleet as the scheduler sees it: who is online, idle, and able to run which task."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from flotilla.core.conditions import DeviceConditions
from flotilla.core.device import DeviceProfile
from flotilla.core.eligibility import EligibilitySection, ineligibility
from flotilla.scheduling.history import FleetHistory, RoundOutcome


@dataclass(slots=True)
class DeviceState:
    profile: DeviceProfile
    last_seen: float
    online: bool = True
    #: The job this device is serving, or None when idle.
    busy_with: str | None = None
    #: What it last said of its battery, power, network and idleness (unknown until then).
    conditions: DeviceConditions = field(default_factory=DeviceConditions)

    def qualifies(self, task: str, policy: EligibilitySection | None) -> bool:
        if task not in self.profile.tasks:
            return False
        return policy is None or ineligibility(policy, self.profile, self.conditions) is None


@dataclass(frozen=True, slots=True)
class DeviceView:
    """One device as an operator sees it."""

    device_id: str
    #: ``offline``, ``idle``, ``busy`` or ``ineligible``.
    state: str
    job_id: str = ""
    reason: str = ""
    last_seen: float = 0.0
    conditions: DeviceConditions = field(default_factory=DeviceConditions)


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

    def report(self, device_id: str, conditions: DeviceConditions) -> None:
        """The device's latest conditions (each poll and heartbeat may carry them)."""
        state = self._devices.get(device_id)
        if state is not None:
            state.conditions = conditions

    def conditions(self, device_id: str) -> DeviceConditions | None:
        state = self._devices.get(device_id)
        return None if state is None else state.conditions

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

    def idle(self, task: str, policy: EligibilitySection | None = None) -> list[DeviceProfile]:
        """Online, idle devices that have ``task`` installed and meet ``policy`` (a job's
        ``[eligibility]``), in a stable order."""
        return [
            s.profile
            for _, s in sorted(self._devices.items())
            if s.online and s.busy_with is None and s.qualifies(task, policy)
        ]

    def eligible(self, task: str, policy: EligibilitySection | None = None) -> list[DeviceProfile]:
        """Online devices that have ``task`` installed and meet ``policy``, busy or not:
        the population a round samples from (its size is the denominator of the sampling
        rate)."""
        return [
            s.profile
            for _, s in sorted(self._devices.items())
            if s.online and s.qualifies(task, policy)
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

    def describe(
        self, task: str = "", policy: EligibilitySection | None = None
    ) -> list[DeviceView]:
        """Every device the pool has seen, in id order; with ``task``, those lacking it are
        ``ineligible``, and with ``policy`` those it excludes, each with the reason (busy
        and offline say so first)."""
        out = []
        for device_id, s in sorted(self._devices.items()):
            seen, conditions = s.last_seen, s.conditions
            if not s.online:
                view = DeviceView(device_id, "offline", last_seen=seen, conditions=conditions)
            elif s.busy_with is not None:
                view = DeviceView(device_id, "busy", s.busy_with, "", seen, conditions)
            elif reason := self._excluded(s, task, policy):
                view = DeviceView(device_id, "ineligible", "", reason, seen, conditions)
            else:
                view = DeviceView(device_id, "idle", last_seen=seen, conditions=conditions)
            out.append(view)
        return out

    @staticmethod
    def _excluded(s: DeviceState, task: str, policy: EligibilitySection | None) -> str | None:
        if task and task not in s.profile.tasks:
            return f"task {task} is not installed"
        return None if policy is None else ineligibility(policy, s.profile, s.conditions)

    def __len__(self) -> int:
        return sum(1 for s in self._devices.values() if s.online)
