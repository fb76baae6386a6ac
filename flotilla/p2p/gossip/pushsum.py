"""A peer's push-sum state, de-biased: the model's own tensors are its estimate of the
network average, and a weight says how much of the network's mass it holds.

Push-sum (Kempe, Dobra and Gehrke, 2003) keeps a numerator ``s`` and a weight ``w`` per
peer; a peer sends part of both, the receiver adds them, and every ``s / w`` converges to
the average, on directed and time-varying graphs. Here the tensors hold ``z = s / w`` and
only the weight moves: a :class:`GossipShare` carries the sender's ``z`` and a part of its
weight, which the sender sets aside as it sends; the receiver mixes
``z <- (w z + w' z') / (w + w')`` and answers how much it took; the sender takes back what
was not taken (all of it when no answer came: unreachable, timed out, refused). The
network's mass (the sum of ``w z``) and weight (the sum of ``w``) never change, so the
network average stays exact when messages are lost, and answers that come late are
settled when they come. A receiver whose answer could not be sent takes its share back
out (:meth:`PushSum.untake`); what stays inexact is an answer lost after it left.

A receiver takes at most one peer's starting weight (1) of a share, or its own weight if
that is more, and says how much it took: whatever weight a neighbour claims, it pulls a peer
at most halfway toward its parameters (one lighter than 1, of weight ``w``, ``1 / (1 + w)``
of the way), while an honest peer that grew heavy still sheds its weight.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flotilla.core.errors import WireError

#: Below this weight a peer stops sending until it receives: its weight halves with every
#: share it gives, and after some thousand unanswered halvings it would underflow.
MIN_SHARE_WEIGHT = 1e-6


@dataclass(frozen=True, eq=False)  # tensors have no one truth value to compare by
class GossipShare:
    """What a peer sends a neighbour at ``step``: its parameters and part of its weight."""

    step: int
    weight: float
    tensors: tuple[torch.Tensor, ...]


class PushSum:
    """Mixes the given tensors in place (a model's parameters); not thread-safe: the peer
    serialises its shares, its takes and its training steps."""

    def __init__(self, tensors: Sequence[torch.Tensor], weight: float = 1.0) -> None:
        self.tensors = tuple(tensors)
        self.weight = weight

    def share(self, step: int, parts: int = 1) -> GossipShare | None:
        """A copy of the parameters and ``1 / (parts + 1)`` of the weight, for each of
        ``parts`` neighbours, set aside until :meth:`settle` says what each took; None
        while the weight is too small to share."""
        if self.weight < MIN_SHARE_WEIGHT:
            return None
        portion = self.weight / (parts + 1)
        self.weight -= parts * portion  # z is unchanged: the mass left is (w - parts p) z
        return GossipShare(step, portion, tuple(t.detach().clone() for t in self.tensors))

    def settle(self, share: GossipShare, taken: float) -> None:
        """A neighbour took ``taken`` of ``share``'s weight (0: it did not answer); the rest,
        with the parameters as sent, is this peer's again."""
        back = share.weight - min(max(taken, 0.0), share.weight)
        if back > 0.0:
            self._add(share, back)

    def untake(self, share: GossipShare, taken: float) -> bool:
        """Give back ``taken`` of a share this peer mixed in, when its sender cannot have
        learnt that it did (the answer could not be sent); False when too little weight is
        left to give it back (then the network holds that share twice)."""
        left = self.weight - taken
        if not 0.0 < taken < self.weight or left < MIN_SHARE_WEIGHT:
            return False
        with torch.no_grad():
            for mine, sent in zip(self.tensors, share.tensors, strict=True):
                # z <- (w z - taken z_sent) / (w - taken): exact whatever changed meanwhile.
                mine.mul_(self.weight / left).sub_(sent.to(mine.dtype), alpha=taken / left)
        self.weight = left
        return True

    def take(self, share: GossipShare) -> float:
        """Mix a neighbour's share in; the weight taken (at most 1, or this peer's own weight
        if that is more). A share of the wrong shapes, dtype or size, with non-finite values
        or a weight that is not positive and finite is refused with WireError, and nothing
        changes."""
        self.check(share)
        taken = min(share.weight, max(self.weight, 1.0))
        self._add(share, taken)
        return taken

    def _add(self, share: GossipShare, weight: float) -> None:
        total = self.weight + weight
        with torch.no_grad():
            for mine, theirs in zip(self.tensors, share.tensors, strict=True):
                mine.mul_(self.weight / total).add_(theirs.to(mine.dtype), alpha=weight / total)
        self.weight = total

    def check(self, share: GossipShare) -> None:
        """WireError unless ``share`` could be mixed into these tensors."""
        if not (math.isfinite(share.weight) and share.weight > 0):
            raise WireError(f"a share's weight must be positive and finite, not {share.weight}")
        if len(share.tensors) != len(self.tensors):
            raise WireError(
                f"a share of {len(share.tensors)} tensors for a model of {len(self.tensors)}"
            )
        for i, (mine, theirs) in enumerate(zip(self.tensors, share.tensors, strict=True)):
            if theirs.shape != mine.shape:
                raise WireError(
                    f"tensor {i} of a share has shape {tuple(theirs.shape)}, "
                    f"not {tuple(mine.shape)}"
                )
            if not theirs.dtype.is_floating_point:
                raise WireError(f"tensor {i} of a share is {theirs.dtype}, not floating point")
            if not bool(torch.isfinite(theirs).all()):
                raise WireError(f"tensor {i} of a share holds NaN or Inf")
