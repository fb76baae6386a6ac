"""The virtual fleet on the engine's device pool: devices come and go on the virtual clock."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator, Mapping, Sequence

from flotilla.core.device import DeviceProfile
from flotilla.scheduling import Leases
from flotilla.simulation.population import (
    AvailabilitySection,
    VirtualDevice,
    sessions,
)


class Fleet:
    """Puts each device in the pool while it is online and takes it out when it is not.

    Availability transitions are timers on the (virtual) event loop, one pending per device.
    """

    def __init__(
        self,
        devices: Sequence[VirtualDevice],
        tasks: tuple[str, ...],
        availability: AvailabilitySection,
        seed: int,
        leases: Leases,
        samples: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        """``samples``: per task, the training samples of each device's shard (by index),
        as a real device reports them with its profile."""
        self.devices = {d.device_id: d for d in devices}
        counts = samples or {}
        self.pool = leases.pool
        self._leases = leases  # a device going offline frees it from its job
        self._profiles = {
            d.device_id: DeviceProfile(
                d.device_id,
                tasks=tasks,
                gflops=d.speed,
                upload_bytes_per_s=d.upload_bytes_per_s,
                samples={task: int(sizes[d.index]) for task, sizes in counts.items()},
                extra={
                    "download_bytes_per_s": d.download_bytes_per_s,
                    "latency_s": d.latency_s,
                },
            )
            for d in devices
        }
        self._availability = availability
        self._seed = seed
        self._next_off: dict[str, float] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def start(self) -> None:
        """Bring the fleet to its state at time 0 and schedule every change after it."""
        loop = asyncio.get_running_loop()
        origin = loop.time()
        for device in self.devices.values():
            changes = sessions(self._availability, self._seed, device.index)
            _, online = next(changes)
            if online:
                self.pool.seen(self._profiles[device.device_id])
            self._schedule(device.device_id, changes, origin)

    def _schedule(
        self, device_id: str, changes: Iterator[tuple[float, bool]], origin: float
    ) -> None:
        upcoming = next(changes, None)
        if upcoming is None:
            self._next_off[device_id] = math.inf
            return
        at, online = upcoming
        if not online:
            self._next_off[device_id] = origin + at
        loop = asyncio.get_running_loop()
        self._timers[device_id] = loop.call_at(
            origin + at, self._change, device_id, online, changes, origin
        )

    def _change(
        self, device_id: str, online: bool, changes: Iterator[tuple[float, bool]], origin: float
    ) -> None:
        if online:
            self.pool.seen(self._profiles[device_id])
        else:
            self._leases.left(device_id)
        self._schedule(device_id, changes, origin)

    def online_until(self, device_id: str) -> float:
        """When the device next goes offline (inf if never)."""
        return self._next_off.get(device_id, math.inf)

    def stop(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
