"""Who a gossiping peer sends to, and waits for, at a step.

Every peer computes the same graph from the same sorted membership (the run's members that
the DHT shows training), so nobody coordinates it; a join or a leave changes the membership
and with it the graph from the next step on. The default is the time-varying one-peer
exponential graph: at step ``t`` peer ``i`` of ``n`` sends to ``i + 2**(t mod ceil(log2 n))``,
so within ``log2 n`` steps every peer's parameters have reached every other, while each
step costs one message per peer.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from flotilla.core.errors import ConfigError

#: ``exponential`` (the default), ``ring`` (to the next peer), ``random`` (one other peer,
#: drawn per step from a seed every peer shares).
TOPOLOGIES = ("exponential", "ring", "random")


@dataclass(frozen=True)
class Graph:
    """A directed graph over the members at each step; one out-neighbour per peer."""

    topology: str = "exponential"
    #: Seed of ``random`` (the run's seed): every peer draws the same neighbours.
    seed: int = 0

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ConfigError(
                f"unknown gossip topology {self.topology!r}; one of {', '.join(TOPOLOGIES)}"
            )

    def out_neighbours(self, members: Sequence[str], me: str, step: int) -> tuple[str, ...]:
        """The peers ``me`` sends its share to at ``step`` (none when alone or not a member)."""
        ordered = sorted(set(members))
        if me not in ordered or len(ordered) < 2:
            return ()
        return (ordered[self._target(ordered, ordered.index(me), step)],)

    def in_neighbours(self, members: Sequence[str], me: str, step: int) -> tuple[str, ...]:
        """The peers that send to ``me`` at ``step``: whom a synchronous step waits for."""
        ordered = sorted(set(members))
        if me not in ordered or len(ordered) < 2:
            return ()
        mine = ordered.index(me)
        return tuple(
            peer
            for i, peer in enumerate(ordered)
            if i != mine and self._target(ordered, i, step) == mine
        )

    def _target(self, ordered: list[str], i: int, step: int) -> int:
        n = len(ordered)
        if self.topology == "ring":
            return (i + 1) % n
        if self.topology == "random":
            other = random.Random(f"{self.seed}:{step}:{ordered[i]}").randrange(n - 1)
            return other if other < i else other + 1
        # 2**k < n for every k below ceil(log2 n): never back to itself.
        return (i + (1 << (step % max(1, math.ceil(math.log2(n)))))) % n
