"""The rendezvous peer devices of server-less rounds meet at, started on first use."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from flotilla.core.errors import FlotillaError, WireError
from flotilla.core.timeouts import Timeouts
from flotilla.server.hosting.children import spawn_ready, stop_child

#: A libp2p peer id as base58 text (RSA ids are 46 characters, Ed25519 ones 52).
PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{32,128}")


class HostedRendezvous:
    """A hivemind DHT node in a child process (flotilla.p2p.rendezvous), shared by every
    server-less job; started when the first of them needs it. The core reaches it through
    ``flotilla.server.federation.ports.Rendezvous``."""

    def __init__(
        self,
        state_dir: Path,
        host_maddrs: Sequence[str] | None = None,
        announce_maddrs: Sequence[str] | None = None,
        timeouts: Timeouts | None = None,
    ) -> None:
        self._dir = state_dir
        self._timeouts = timeouts or Timeouts()
        self._host_maddrs = host_maddrs
        self._announce_maddrs = announce_maddrs
        self._lock = asyncio.Lock()
        self._proc: asyncio.subprocess.Process | None = None
        self._maddrs: tuple[str, ...] = ()
        #: Device id -> the hivemind peer id its agent announced (with every poll).
        self._peer_ids: dict[str, str] = {}

    def peer_seen(self, device_id: str, peer_id: str) -> None:
        """Remember an authenticated device's peer id; WireError if it is not one."""
        if not PEER_ID.fullmatch(peer_id):
            raise WireError(f"p2p_peer_id {peer_id[:140]!r} is not a base58 peer id")
        self._peer_ids[device_id] = peer_id

    def members(self, device_ids: Iterable[str]) -> dict[str, str]:
        """Peer id -> device id for the devices that announced a peer; a round's group
        plan names these, and members refuse every other peer. A peer id two of them
        announced is left out: libp2p lets only one of them hold it, and the server cannot
        tell which."""
        named: dict[str, str] = {}
        clashes: set[str] = set()
        for device_id in device_ids:
            peer = self._peer_ids.get(device_id)
            if peer is not None:
                if peer in named:
                    clashes.add(peer)
                named[peer] = device_id
        return {peer: d for peer, d in named.items() if peer not in clashes}

    async def peers(self) -> tuple[str, ...]:
        """The multiaddrs devices join at; (re)starts the peer if it is not running."""
        async with self._lock:
            if self._proc is None or self._proc.returncode is not None:
                self._proc, info = await spawn_ready(
                    self._args(),
                    self._dir,
                    "rendezvous.json",
                    "the p2p rendezvous peer",
                    self._timeouts.child_start_s,
                )
                self._maddrs = tuple(str(m) for m in info["maddrs"])
                if not self._maddrs:
                    raise FlotillaError("the p2p rendezvous peer listens nowhere")
            return self._maddrs

    def _args(self) -> list[str]:
        args = ["-m", "flotilla.p2p.rendezvous", "--state-dir", str(self._dir)]
        if self._host_maddrs:
            args += ["--host-maddrs", *self._host_maddrs]
        if self._announce_maddrs:
            args += ["--announce-maddrs", *self._announce_maddrs]
        return args

    async def stop(self) -> None:
        if self._proc is not None:
            await stop_child(self._proc, self._timeouts.child_stop_s)
            self._proc = None
