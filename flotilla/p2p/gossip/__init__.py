"""Gossip averaging for volunteer runs: each peer mixes its parameters with one or a few
neighbours after its local steps, with no group to form and no barrier (docs/p2p.md,
"Gossip").

- :mod:`flotilla.p2p.gossip.graph` -- who mixes with whom at a step, from the membership.
- :mod:`flotilla.p2p.gossip.pushsum` -- a peer's push-sum state: shares it sends, shares
  it takes, the network average kept unbiased when messages are lost.
- :mod:`flotilla.p2p.gossip.peer` -- one peer's gossip step over any transport.
- :mod:`flotilla.p2p.gossip.wire` -- shares over hivemind's libp2p (docs/p2p-protocol.md).
- :mod:`flotilla.p2p.gossip.runner` -- a peer's gossip on a thread beside its training.
- :mod:`flotilla.p2p.gossip.consensus` -- how far apart the peers are, from sketches.
"""

from flotilla.p2p.gossip.graph import TOPOLOGIES, Graph
from flotilla.p2p.gossip.pushsum import GossipShare, PushSum

__all__ = ["TOPOLOGIES", "GossipShare", "Graph", "PushSum"]
