"""One gossiping peer: a step's shares out, its neighbours' shares in, over any transport.

A step sends this peer's share to its out-neighbours (the graph at that step over the
current members), setting its weight aside, and waits for their answers at most ``wait_s``
from the step's start (``sync``: half of it); an answer that comes later is settled when it
comes (the transport's own time limit bounds it), so a slow link costs no mass. In ``sync``
mode it also waits, at most half of ``wait_s``, for the shares its in-neighbours send at
the same step and mixes them then, so both sides of every edge mix the same step while
links deliver; in ``async`` mode a share is mixed the moment it arrives, whatever step either
side is at. A share for a step this peer has passed is mixed at once in both modes. One
for a step it has not reached is held until it gets there, for as long as the share's
sender said it can wait (``hold_s``, its own wait less a margin for the answer's way
back); if that runs out it is answered "nothing taken", and the sender takes its weight
back. A lost share costs its receiver at most half a wait, so a receiver that waited in
vain still reaches its next step before that step's senders give up; and it does not wait
for that sender again until a share of its arrives (a peer killed without a goodbye costs
each of its neighbours one half-wait; a slow one's shares are mixed as they come).

Nothing here knows the network: the transport sends a share and returns the weight taken,
and calls :meth:`GossipPeer.receive` for each share that arrives (in-process in tests,
hivemind's libp2p in a volunteer run). All of it runs on one asyncio loop; the lock is for
the training thread, which holds it while its optimizer changes the same tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from flotilla.core.errors import AnswerLost, FlotillaError, UpdateRejected
from flotilla.p2p.gossip.graph import Graph
from flotilla.p2p.gossip.pushsum import GossipShare, PushSum

log = logging.getLogger(__name__)

#: ``sync`` (both sides of an edge mix the same step) or ``async`` (mix on arrival).
MODES = ("sync", "async")
#: Of a sender's wait, the part a receiver may hold its early share (the rest is for the
#: answer's way back).
HOLD_FRACTION = 0.9


class ShareTransport(Protocol):
    async def send(self, peer: str, share: GossipShare, hold_s: float) -> float:
        """Deliver ``share`` to ``peer``, which may hold it ``hold_s`` for its step; the
        weight it took. Raises when it was not delivered (unreachable, timed out, refused):
        then nothing was taken."""
        ...


@dataclass(frozen=True)
class StepReport:
    """What one gossip step did, for the peer's log and its status."""

    step: int
    sent_to: tuple[str, ...]
    #: Of ``sent_to``, those that took (part of) the share.
    taken_by: tuple[str, ...]
    #: Peers whose shares this step mixed (sync: its in-neighbours that sent in time).
    mixed_from: tuple[str, ...]
    weight: float


class GossipPeer:
    def __init__(
        self,
        me: str,
        state: PushSum,
        graph: Graph,
        transport: ShareTransport,
        members: Callable[[], Sequence[str]],
        *,
        mode: str = "sync",
        wait_s: float,
        first_step: int = 0,
    ) -> None:
        """``first_step``: the step this peer gossips first (a peer joining a run in
        progress starts at the run's); shares of earlier steps are mixed on arrival."""
        if mode not in MODES:
            raise ValueError(f"gossip mode is one of {', '.join(MODES)}, not {mode!r}")
        self.me, self.state, self.graph = me, state, graph
        self._transport, self._members = transport, members
        self._mode, self._wait_s = mode, wait_s
        #: Held while the tensors change: a mix here, an optimizer step in the training thread.
        self.lock = threading.Lock()
        self._step = first_step - 1
        #: Set while a peer joining a run in progress waits for its first mix: it mixes
        #: every share on arrival, whatever its step (it has no step of its own yet).
        self.catching_up = False
        #: Shares waiting for a step this peer has not mixed yet: step -> (sender, share,
        #: the answer its sender waits for).
        self._early: dict[int, list[tuple[str, GossipShare, asyncio.Future[float]]]] = {}
        self._refused: set[str] = set()
        #: Shares refused because their sender is not a member: a peer the membership has
        #: not seen yet (its owner may read the members again) or an intruder.
        self.strangers = 0
        self._mixed_now: list[str] = []
        #: In-neighbours whose share missed a sync step's wait (left, or slow): not waited
        #: for again until a share of theirs arrives, so a peer killed without a goodbye
        #: costs its neighbours one wait, not one at every step until the membership drops it.
        self._late: set[str] = set()
        self._arrived = asyncio.Event()
        self._stepping = asyncio.Lock()
        #: Sends whose answer has not come: their weight is set aside until it does.
        self._sending: set[asyncio.Future[float]] = set()
        #: Weight of shares whose answer was lost after they arrived (the stream ended
        #: first): taken back here, and maybe mixed there. The one way the network's weight
        #: (and average) can drift; counted so that it can be told.
        self.uncertain = 0.0

    @property
    def unsettled(self) -> int:
        """Shares sent whose answer has not come yet."""
        return len(self._sending)

    @property
    def held(self) -> int:
        """Shares waiting for a step this peer has not reached."""
        return sum(len(waiting) for waiting in self._early.values())

    async def receive(self, sender: str, share: GossipShare, hold_s: float) -> float:
        """A neighbour's share arrived: the weight taken (0 when it came for a step this
        peer did not reach within ``hold_s``). UpdateRejected for a sender outside the run,
        WireError for a share that does not fit this model; each logged once per sender."""
        try:
            if sender not in self._members():
                self.strangers += 1
                raise UpdateRejected(f"{sender} is not a member of this run")
            self.state.check(share)
            self._late.discard(sender)
        except FlotillaError as exc:
            if sender not in self._refused:
                self._refused.add(sender)
                log.warning("refused a gossip share from %s: %s", sender, exc)
            raise
        if self._mode == "async" or share.step <= self._step or self.catching_up:
            return self._take(sender, share)
        answer: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        held = (sender, share, answer)
        self._early.setdefault(share.step, []).append(held)
        try:
            hold = min(max(hold_s, 0.0), self._wait_s)
            return await asyncio.wait_for(asyncio.shield(answer), hold)
        except asyncio.TimeoutError:
            if answer.done():  # mixed just as the wait ran out
                return answer.result()
            return 0.0  # never mixed now: the sender takes its weight back
        except asyncio.CancelledError:  # the sender hung up: it will take its weight back
            if answer.done() and not answer.cancelled():
                self.untake(sender, share, answer.result())
            raise
        finally:  # answered, timed out, or the sender hung up: never mix it later
            answer.cancel()
            self._forget(share.step, held)

    def untake(self, sender: str, share: GossipShare, taken: float) -> None:
        """Give back a share mixed in whose answer could not be sent (its sender will take
        the weight back): else the network would hold it twice."""
        if taken <= 0.0:
            return
        with self.lock:
            undone = self.state.untake(share, taken)
        log.debug(
            "step %d: the answer to %s was lost; %s", share.step, sender,
            "its share taken back out" if undone else "too light to take its share back out",
        )  # fmt: skip

    def _forget(self, step: int, held: tuple[str, GossipShare, asyncio.Future[float]]) -> None:
        """Drop a share no longer held (a far-future step must not pin its tensors)."""
        waiting = [h for h in self._early.get(step, []) if h is not held]
        if waiting:
            self._early[step] = waiting
        else:
            self._early.pop(step, None)

    async def gossip(self, step: int) -> StepReport:
        """Step ``step``: send this peer's share, mix what its neighbours sent (sync: wait
        for them at most ``wait_s``), give up what was taken. A step asked for while the
        last one still runs (delayed averaging) starts when it ends."""
        async with self._stepping:
            return await self._gossip(step)

    async def _gossip(self, step: int) -> StepReport:
        began = asyncio.get_running_loop().time()
        deadline = began + self._wait_s
        members = list(self._members())
        targets = self.graph.out_neighbours(members, self.me, step)
        with self.lock:
            share = self.state.share(step, len(targets)) if targets else None
        sends: dict[str, asyncio.Future[float]] = {}
        if share is not None:
            hold_s = self._wait_s * HOLD_FRACTION
            sends = {p: asyncio.ensure_future(self._send(p, share, hold_s)) for p in targets}
            self._sending.update(sends.values())
            for sent in sends.values():
                sent.add_done_callback(self._sending.discard)
        self._step = step
        if self._mode == "sync":  # async counts what arrived since its last step's end
            self._mixed_now = []
        self._mix_early(step)
        if self._mode == "sync":
            await self._await_neighbours(members, step, began + self._wait_s / 2)
        if sends:  # answers that come later are settled when they come
            # sync: a step lasts at most half a wait, as its in-neighbours' (its answers
            # are not needed to mix); async: a step runs beside training, its answers in.
            until = began + self._wait_s / 2 if self._mode == "sync" else deadline
            remaining = max(0.0, until - asyncio.get_running_loop().time())
            await asyncio.wait(sends.values(), timeout=remaining)
        taken_by = tuple(
            p for p, sent in sends.items()
            if sent.done() and not sent.cancelled() and sent.result() > 0
        )  # fmt: skip
        mixed_from, self._mixed_now = tuple(self._mixed_now), []
        return StepReport(step, tuple(sends), taken_by, mixed_from, self.state.weight)

    async def _send(self, peer: str, share: GossipShare, hold_s: float) -> float:
        """Send ``share`` to ``peer``; whatever happens, settle it: what was not taken (all
        of it without an answer) is this peer's again."""
        taken = 0.0
        try:
            taken = min(max(await self._transport.send(peer, share, hold_s), 0.0), share.weight)
        except AnswerLost as exc:
            self.uncertain += share.weight
            log.info(
                "step %d: %r (its weight, %.3g, comes back here)", share.step, exc, share.weight
            )
        except Exception as exc:  # unreachable, timed out, refused: nothing was taken
            log.debug("step %d: %s took nothing: %r", share.step, peer, exc)
        finally:  # also when cancelled (the peer closes): then nothing is known taken
            with self.lock:
                self.state.settle(share, taken)
        return taken

    async def _await_neighbours(self, members: Sequence[str], step: int, deadline: float) -> None:
        """Until every in-neighbour's share of ``step`` is mixed, or the deadline: they
        arrive through :meth:`receive`, which mixes them at once now the step is current."""
        self._late &= set(members)  # those gone from the run need no more remembering
        expected = set(self.graph.in_neighbours(members, self.me, step)) - self._late
        loop = asyncio.get_running_loop()
        while not expected <= set(self._mixed_now) and loop.time() < deadline:
            self._arrived.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), deadline - loop.time())
        self._late |= expected - set(self._mixed_now)

    def _mix_early(self, step: int) -> None:
        for due in sorted(s for s in self._early if s <= step):
            for sender, share, answer in self._early.pop(due):
                if not answer.done():
                    answer.set_result(self._take(sender, share))

    def _take(self, sender: str, share: GossipShare) -> float:
        with self.lock:
            taken = self.state.take(share)
        self._mixed_now.append(sender)
        self._arrived.set()
        return taken

    def close(self) -> None:
        """Answer every share still waiting "nothing taken": their senders take them back;
        cancel this peer's sends still waiting for an answer (their weight comes back)."""
        for sent in list(self._sending):
            sent.cancel()
        for waiting in self._early.values():
            for _, _, answer in waiting:
                with contextlib.suppress(asyncio.InvalidStateError):
                    answer.set_result(0.0)
        self._early.clear()
