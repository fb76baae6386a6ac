"""What a process lends every job it runs: devices, storage, clock, pacing."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from flotilla.core.events import EventSink, NoEvents
from flotilla.engine.backend import Backend
from flotilla.engine.ports import Blobs, Ledger
from flotilla.engine.stages import DeviceKeys
from flotilla.scheduling import Arbiter, Leases


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine pacing that is not part of a job's spec."""

    #: Once at least min_quorum devices are idle, wait this long for k before starting.
    selection_grace_s: float = 2.0
    #: Pause before retrying a round that failed to reach quorum.
    retry_pause_s: float = 1.0
    #: How often to look for idle devices while waiting.
    idle_poll_s: float = 0.1
    #: A round whose aggregate is refused this many times in a row fails the job: its
    #: updates keep producing a model that must not be committed (NaN, overflow), and
    #: retrying forever would hold devices other jobs need.
    max_refused_rounds: int = 5
    #: Jobs deciding at the same moment get contested devices by one assignment (each to
    #: the job it is relatively fastest for); False: each in turn, oldest first.
    joint_assignment: bool = True


class P2PPeers(Protocol):
    """Where devices meet for server-less rounds (``transport = "p2p"``)."""

    async def peers(self) -> tuple[str, ...]:
        """The multiaddrs of the rendezvous peers devices bootstrap from."""
        ...

    def members(self, device_ids: Iterable[str]) -> Mapping[str, str]:
        """Peer id -> device id of those devices whose peers are known: the members a
        round's group admits (empty: no membership check)."""
        ...


@dataclass(frozen=True, slots=True)
class EngineServices:
    """Shared by every job of one server or simulation: jobs asking for devices at the
    same moment are decided jointly by ``arbiter``; ``leases`` owns who serves whom."""

    backend: Backend
    leases: Leases
    arbiter: Arbiter
    ledger: Ledger
    blobs: Blobs
    clock: Callable[[], float]
    config: EngineConfig = field(default_factory=EngineConfig)
    #: None where the backend cannot run server-less rounds.
    p2p: P2PPeers | None = None
    #: Told of rounds committed and retried, failed devices and job state changes (a
    #: server passes its metrics and live feed; a simulation nobody watches passes none).
    events: EventSink = field(default_factory=NoEvents)
    #: Devices' identity keys, for secure rounds; None where there are none (simulation).
    keys: DeviceKeys | None = None
