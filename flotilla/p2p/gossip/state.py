"""A gossip run's state over libp2p: a peer's parameters, push-sum weight and epoch.

Gossip peers serve theirs, so the coordinator can checkpoint the run (the weighted mean of
its members' states: the network average push-sum keeps); the coordinator serves its last
checkpoint, so peers that join a run every volunteer has left resume from it rather than
from scratch.

A request is one empty ``DownloadData`` on ``SWARM::gossip_state``; the answer is a gossip
share's stream (:mod:`flotilla.p2p.gossip.wire`) whose ``step`` is the epoch, ``hold_s``
0, and whose tensors are uncompressed (a checkpoint is exact). A peer with nothing to serve
yet (a coordinator before its first checkpoint) ends the stream with no message.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import torch
from hivemind.compression import NoCompression
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto.averaging_pb2 import DownloadData

from flotilla.core.errors import Unreachable, WireError
from flotilla.p2p.gossip.pushsum import GossipShare, PushSum
from flotilla.p2p.gossip.wire import read_share, share_messages

log = logging.getLogger(__name__)

#: The most a served state's weight counts in a checkpoint's mean (one peer's start).
MAX_STATE_WEIGHT = 1.0


def state_handler_name(swarm: str) -> str:
    return f"{swarm}::gossip_state"


async def serve_state(p2p: P2P, swarm: str, state: Callable[[], GossipShare | None]) -> None:
    """Answer state requests with what ``state()`` returns then (None: nothing to serve)."""

    async def handle(_: DownloadData, context: P2PContext) -> AsyncIterator[DownloadData]:
        snapshot = await asyncio.to_thread(state)
        if snapshot is None:
            return
        messages = await asyncio.to_thread(share_messages, snapshot, NoCompression(), 0.0)
        log.debug("served the run's state to %s", context.remote_id)
        for message in messages:
            yield message

    await p2p.add_protobuf_handler(
        state_handler_name(swarm), handle, DownloadData, stream_output=True
    )


async def fetch_state(
    p2p: P2P, swarm: str, peer: str, shapes: Sequence[torch.Size], idle_s: float
) -> GossipShare:
    """``peer``'s state for a model of ``shapes``: WireError when it serves none or a
    malformed one (wrong shapes, NaN or Inf, too large), Unreachable when it does not
    answer, or goes silent for ``idle_s``."""
    try:
        stream = await p2p.iterate_protobuf_handler(
            PeerID.from_base58(peer), state_handler_name(swarm), DownloadData(), DownloadData
        )
        first = await anext(stream, None)
        if first is None:
            raise WireError(f"{peer} has no state to serve yet")

        async def whole() -> AsyncIterator[DownloadData]:
            yield first
            async for message in stream:
                yield message

        share, _ = await read_share(whole(), shapes, idle_s)
    except WireError:
        raise
    except Exception as exc:  # a peer gone, a reset, a refusal: no state from it
        raise Unreachable(f"{peer} served no state: {exc!r}") from None
    PushSum([torch.empty(s) for s in shapes]).check(share)
    return share


def fetch_from_thread(
    loop: asyncio.AbstractEventLoop,
    p2p: P2P,
    swarm: str,
    peers: Sequence[str],
    shapes: Sequence[torch.Size],
    timeout_s: float,
) -> list[GossipShare | Exception]:
    """:func:`fetch_state` from each of ``peers`` at once (over a slow link one takes
    seconds), on ``loop`` (which runs in another thread), for a caller outside it: each
    peer's state or why not (Unreachable past ``timeout_s``)."""

    def late(peer: str) -> Unreachable:
        return Unreachable(f"{peer} served no state within {timeout_s:.0f} s")

    async def one(peer: str) -> GossipShare:
        try:
            return await asyncio.wait_for(
                fetch_state(p2p, swarm, peer, shapes, timeout_s), timeout_s
            )
        except asyncio.TimeoutError:
            raise late(peer) from None

    async def every() -> list[GossipShare | Exception]:
        got = await asyncio.gather(*(one(p) for p in peers), return_exceptions=True)
        # a cancellation (the loop closing) counts as no answer
        return [g if isinstance(g, GossipShare | Exception) else Unreachable(repr(g)) for g in got]

    future = asyncio.run_coroutine_threadsafe(every(), loop)
    try:
        return future.result(timeout=timeout_s + 1.0)
    except (TimeoutError, concurrent.futures.TimeoutError):
        future.cancel()
        return [late(p) for p in peers]


def fetch_one(
    loop: asyncio.AbstractEventLoop,
    p2p: P2P,
    swarm: str,
    peer: str,
    shapes: Sequence[torch.Size],
    timeout_s: float,
) -> GossipShare:
    """:func:`fetch_from_thread` of one peer: its state, or the reason raised."""
    (got,) = fetch_from_thread(loop, p2p, swarm, [peer], shapes, timeout_s)
    if isinstance(got, Exception):
        raise got
    return got


def mean_state(states: Sequence[GossipShare]) -> GossipShare:
    """The push-sum network average of ``states`` (each z weighted by its weight), at the
    newest epoch among them, with weight 1. A state counts at most one peer's weight (1):
    the weight is the serving peer's own word, and no member may outweigh the others by
    claiming more (as a receiver of a share takes at most that much)."""
    weights = [min(s.weight, MAX_STATE_WEIGHT) for s in states]
    total = sum(weights)
    tensors = tuple(
        sum((w / total) * s.tensors[i].float() for w, s in zip(weights, states, strict=True))
        for i in range(len(states[0].tensors))
    )
    return GossipShare(max(s.step for s in states), 1.0, tensors)  # type: ignore[arg-type]


class StateService:
    """The coordinator's side of a gossip run's state: fetches its members' states and
    serves one (its checkpoint), on a libp2p replica of the coordinator's DHT node in a
    thread of its own."""

    def __init__(self, dht: Any, swarm: str, shapes: Sequence[torch.Size]) -> None:
        self._dht, self._swarm, self._shapes = dht, swarm, tuple(shapes)
        self._offered: GossipShare | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="state", daemon=True)
        self._p2p: Any = None

    def start(self, start_s: float) -> StateService:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open(), self._loop).result(timeout=start_s)
        return self

    async def _open(self) -> None:
        self._p2p = await self._dht.replicate_p2p()
        await serve_state(self._p2p, self._swarm, lambda: self._offered)

    def offer(self, state: GossipShare) -> None:
        """Serve ``state`` from now on."""
        self._offered = state

    def fetch(self, peer: str, timeout_s: float) -> GossipShare:
        """``peer``'s state (:func:`fetch_state`), within ``timeout_s`` or Unreachable."""
        return fetch_one(self._loop, self._p2p, self._swarm, peer, self._shapes, timeout_s)

    def fetch_all(self, peers: Sequence[str], timeout_s: float) -> list[GossipShare | Exception]:
        """Each of ``peers``' states, fetched at once, or why not, within ``timeout_s``."""
        return fetch_from_thread(self._loop, self._p2p, self._swarm, peers, self._shapes, timeout_s)

    def close(self, close_s: float) -> None:
        if not self._thread.is_alive():
            return
        if self._p2p is not None:
            done = asyncio.run_coroutine_threadsafe(self._p2p.shutdown(), self._loop)
            try:
                done.result(timeout=close_s)
            except Exception as exc:  # the process exits anyway
                log.debug("the state service's libp2p replica did not close: %r", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=close_s)
