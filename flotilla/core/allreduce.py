"""What the devices of a server-less round are told, and tell back about their group.

A job with ``[aggregation] transport = "p2p"`` has its round's devices all-reduce their
updates among themselves (flotilla.p2p.federated); the server sends each a
:class:`GroupPlan` in its task config and learns each member's :class:`Contribution` from
their reports.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from flotilla.core.errors import WireError

#: Most members a group plan may name (a round selects far fewer devices).
MAX_MEMBERS = 4096


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """What the server tells the round's agents about their all-reduce (the task config's
    ``p2p`` section)."""

    #: The server's rendezvous peers.
    initial_peers: tuple[str, ...]
    #: Agents selected for the round: the group forms as soon as this many are in.
    group_size: int
    #: Fewest agents an all-reduce may go ahead with once ``matchmaking_s`` has passed.
    min_group_size: int
    #: How long agents wait for each other before averaging with whoever is there.
    matchmaking_s: float
    #: hivemind compression of the parts on the wire: none, fp16 or int8.
    compression: str = "none"
    #: A sender or reducer silent this long between chunks is dropped from the round.
    chunk_timeout_s: float = 5.0
    #: The next model is ``base + server_lr * average`` (flotilla.compression.apply_average).
    server_lr: float = 1.0
    #: hivemind peer id (base58) -> device id of the selected devices. When set, members
    #: refuse any other peer, and any peer claiming another device's id, in their group.
    members: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> GroupPlan:
        try:
            plan = cls(
                initial_peers=tuple(str(p) for p in raw["initial_peers"]),
                group_size=int(raw["group_size"]),
                min_group_size=int(raw["min_group_size"]),
                matchmaking_s=float(raw["matchmaking_s"]),
                compression=str(raw.get("compression", "none")),
                chunk_timeout_s=float(raw.get("chunk_timeout_s", 5.0)),
                server_lr=float(raw.get("server_lr", 1.0)),
                members=_members(raw.get("members", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(f"task config p2p section is malformed: {exc}") from exc
        if not plan.initial_peers or not 1 <= plan.min_group_size <= plan.group_size:
            raise WireError("task config p2p section names no peers or impossible group sizes")
        return plan

    def to_dict(self) -> dict[str, Any]:
        return {
            "initial_peers": list(self.initial_peers),
            "group_size": self.group_size,
            "min_group_size": self.min_group_size,
            "matchmaking_s": self.matchmaking_s,
            "compression": self.compression,
            "chunk_timeout_s": self.chunk_timeout_s,
            "server_lr": self.server_lr,
            "members": dict(self.members),
        }


def _members(raw: Any) -> dict[str, str]:
    if not isinstance(raw, dict) or len(raw) > MAX_MEMBERS:
        raise ValueError(f"members must be a mapping of at most {MAX_MEMBERS} peers")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
        raise ValueError("members must map peer ids to device ids (strings)")
    return dict(raw)


@dataclass(frozen=True, slots=True)
class Contribution:
    """One device's part in a server-less (all-reduced) round, as its group saw it."""

    device_id: str
    num_samples: int
    metrics: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_id": self.device_id,
            "num_samples": self.num_samples,
            "metrics": self.metrics,
        }

    @classmethod
    def from_dict(cls, raw: Any) -> Contribution:
        """Checked: it comes from other peers. Non-finite metrics are dropped."""
        if not isinstance(raw, dict) or not isinstance(raw.get("device_id"), str):
            raise WireError(f"{raw!r} is not a contribution")
        metrics = raw.get("metrics", {})
        samples = raw.get("num_samples")
        if not isinstance(metrics, dict) or not isinstance(samples, int) or samples <= 0:
            raise WireError(f"contribution of {raw['device_id']!r} is malformed")
        clean: dict[str, float] = {}
        for key, value in metrics.items():
            if isinstance(value, int | float) and math.isfinite(value):
                clean[str(key)] = float(value)
        return cls(raw["device_id"], samples, clean)


@dataclass(frozen=True, slots=True)
class PeerOptions:
    """Where an agent's hivemind peer listens (loopback unless told otherwise)."""

    host_maddrs: tuple[str, ...] | None = None
    announce_maddrs: tuple[str, ...] | None = None
    client_mode: bool = False
    identity_path: Path | None = None


@dataclass(frozen=True, slots=True)
class GroupAgreement:
    """What a device's group agreed on in one server-less round: the next model's
    SHA-256 (as the server will rebuild it), the upload the server may ask for (the
    group's average update), and who took part."""

    model_sha256: str
    upload: bytes
    contributors: tuple[Contribution, ...]
    group_id: str
    seconds: float
    #: Attempts reverted (incomplete) before the committed one.
    reverted: int = 0


class GroupAveraging(Protocol):
    """A device's peer in the swarm of server-less rounds (``flotilla.p2p.federated``
    implements it with hivemind); the agent takes it as a seam, so it can run without."""

    def agree(
        self,
        group_key: str,
        base: memoryview,
        delta: Any,
        me: Contribution,
        timeout_s: float,
        config: Any,
    ) -> GroupAgreement:
        """All-reduce ``delta`` with the round's group; blocks at most ``timeout_s`` and
        raises ``FlotillaError`` when no complete round could be made in time."""
        ...

    def shutdown(self) -> None: ...
