"""What the core needs from the hivemind peers the server hosts, as small protocols.

The peers themselves are child processes (``flotilla.server.hosting``); the composition
root (``flotilla.server.app``) hands their handles to the core, which never imports
hivemind, the hosting code or an edge.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from flotilla.core.errors import SpecError
from flotilla.server.federation.views import VolunteerRunInfo


class Rendezvous(Protocol):
    """Where devices of server-less rounds meet, and which peer is which device."""

    async def peers(self) -> tuple[str, ...]:
        """The multiaddrs devices join at (the peer starts on first use)."""
        ...

    def peer_seen(self, device_id: str, peer_id: str) -> None:
        """Remember an authenticated device's peer id; WireError if it is not one."""
        ...

    def members(self, device_ids: Iterable[str]) -> dict[str, str]:
        """Peer id -> device id of those devices whose peers are known and unambiguous."""
        ...


class VolunteerRuns(Protocol):
    """The volunteer runs this server coordinates."""

    def infos(self) -> Sequence[VolunteerRunInfo]: ...


@dataclass(frozen=True, slots=True)
class Hosted:
    """The hivemind peers the server hosts, as the core sees them."""

    rendezvous: Rendezvous
    volunteers: VolunteerRuns


def require_p2p() -> None:
    """Refuse a ``transport = "p2p"`` job on a server without hivemind, at submission."""
    if importlib.util.find_spec("hivemind") is None:
        raise SpecError(
            'aggregation.transport = "p2p" needs the p2p extra on the server '
            "(pip install 'flotilla[p2p]')"
        )
