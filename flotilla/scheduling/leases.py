"""Device leases: the one owner of which device serves which job.

A device is taken for a job only by :meth:`Leases.dispatch`, which claims the devices of
an arbiter's grant and hands them to the backend in one synchronous call, so nothing can
await between the claim and the dispatch (a claimed device the backend has no task for
looks idle to it and would be freed for a second job). Every way a device is let go (its
update was settled, it failed, timed out, went stale, abandoned the task, left, went
silent, dropped out, never picked the offer up, or its job's round ended) reaches the pool
through this module: backends report it as :class:`DeviceEvents`, the engine through its
:class:`Lease`. Nothing else calls the pool's ``claim`` or ``release``
(``tests/test_leases.py`` checks the source).

Leases keeps no state of its own: occupancy lives in the :class:`DevicePool`, so any two
``Leases`` over one pool agree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from flotilla.scheduling.arbiter import Grant
from flotilla.scheduling.pool import DevicePool

T = TypeVar("T")


class DeviceEvents(Protocol):
    """What a backend reports about its devices; it never frees one itself."""

    def freed(self, device_id: str, job_id: str) -> None:
        """``device_id`` owes ``job_id`` nothing more (if that job still holds it)."""
        ...

    def left(self, device_id: str) -> None:
        """``device_id`` went offline for good; whatever job held it lets go."""
        ...


@dataclass(frozen=True, slots=True)
class Lease(Generic[T]):
    """Devices one job holds for one dispatch, and what the backend returned for them."""

    job_id: str
    devices: tuple[str, ...]
    #: What the dispatch returned (the round's result stream).
    work: T
    leases: Leases

    def free(self, device_ids: Iterable[str]) -> None:
        """Let go of those of ``device_ids`` this lease holds (a round ended for them)."""
        held = set(self.devices)
        for device_id in device_ids:
            if device_id in held:
                self.leases.freed(device_id, self.job_id)


class Leases:
    """Claims devices for jobs and frees them; the pool's only writer of occupancy."""

    def __init__(self, pool: DevicePool) -> None:
        self.pool = pool

    def dispatch(self, grant: Grant, start: Callable[[Sequence[str]], T]) -> Lease[T] | None:
        """Claim the granted devices still online and idle, and call ``start`` with them at
        once; None (nothing started) when none is left. If ``start`` raises, the devices
        are freed again."""
        devices = [
            d for d in grant.redeem() if self.pool.is_online(d) and self.pool.busy_with(d) is None
        ]
        if not devices:
            return None
        self.pool.claim(devices, grant.job_id)
        try:
            work = start(devices)
        except BaseException:
            for device_id in devices:
                self.pool.release(device_id, grant.job_id)
            raise
        return Lease(grant.job_id, tuple(devices), work, self)

    def freed(self, device_id: str, job_id: str) -> None:
        self.pool.release(device_id, job_id)

    def left(self, device_id: str) -> None:
        holder = self.pool.busy_with(device_id)
        self.pool.leave(device_id)
        if holder is not None:
            self.pool.release(device_id, holder)

    def holder(self, device_id: str) -> str | None:
        """The job ``device_id`` serves, or None."""
        return self.pool.busy_with(device_id)
