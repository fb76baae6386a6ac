"""A gossiping peer beside a training thread: its asyncio loop runs in a thread of its own,
on the libp2p daemon of the peer's DHT node.

The training thread calls :meth:`GossipRunner.step` after its local steps and gets a
future: a synchronous peer waits for it before its next step; a peer with delayed averaging
goes on computing while the step's shares travel, and collects it one step later (its
mixing then lags one step: staleness 1). Both hold :attr:`GossipRunner.lock` while their
optimizer changes the parameters, since mixing changes them in place.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from hivemind.compression import CompressionBase

from flotilla.p2p.gossip.graph import Graph
from flotilla.p2p.gossip.peer import GossipPeer, StepReport
from flotilla.p2p.gossip.pushsum import GossipShare, PushSum
from flotilla.p2p.gossip.state import fetch_one, serve_state, state_handler_name
from flotilla.p2p.gossip.wire import LibP2PTransport, handler_name

log = logging.getLogger(__name__)


class GossipRunner:
    def __init__(
        self,
        dht: Any,
        swarm: str,
        tensors: Sequence[torch.Tensor],
        members: Callable[[], Sequence[str]],
        *,
        graph: Graph,
        compression: CompressionBase,
        mode: str,
        wait_s: float,
        weight: float = 1.0,
        first_step: int = 0,
        epoch: Callable[[], int] = lambda: 0,
    ) -> None:
        """``weight``: the push-sum weight to start with (1; less for a peer joining a run
        in progress, whose parameters should count for little until it has mixed), and
        ``first_step`` the step it gossips first (the run's, for such a peer); ``epoch``
        says the training's epoch, served with the parameters (:mod:`.state`)."""
        self._dht, self._swarm, self._members, self._epoch = dht, swarm, members, epoch
        self._state = PushSum(tensors, weight)
        self._graph, self._compression, self._mode, self._wait_s = graph, compression, mode, wait_s
        self._first_step = first_step
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(_quiet_shutdown)
        self._thread = threading.Thread(target=self._loop.run_forever, name="gossip", daemon=True)
        self._peer: GossipPeer | None = None
        self._p2p: Any = None

    @property
    def me(self) -> str:
        return str(self._dht.peer_id)

    @property
    def weight(self) -> float:
        return self._state.weight

    def catch_up(self, on: bool) -> None:
        """While on, mix every share on arrival (a peer joining a run in progress)."""
        assert self._peer is not None, "start() first"
        self._peer.catching_up = on

    @property
    def strangers(self) -> int:
        """Shares refused from non-members so far (:attr:`GossipPeer.strangers`)."""
        return 0 if self._peer is None else self._peer.strangers

    @property
    def uncertain(self) -> float:
        """Weight of shares whose answer was lost on the way (:attr:`GossipPeer.uncertain`)."""
        return 0.0 if self._peer is None else self._peer.uncertain

    @property
    def unsettled(self) -> int:
        """Shares sent whose answer has not come (their weight is set aside meanwhile)."""
        return 0 if self._peer is None else self._peer.unsettled

    @property
    def lock(self) -> threading.Lock:
        """Held by whoever changes the parameters: mixing here, the optimizer there."""
        assert self._peer is not None, "start() first"
        return self._peer.lock

    def start(self, start_s: float) -> GossipRunner:
        """Serve this run's shares; ready within ``start_s`` or TimeoutError."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open(), self._loop).result(timeout=start_s)
        return self

    async def _open(self) -> None:
        self._p2p = await self._dht.replicate_p2p()
        shapes = [t.shape for t in self._state.tensors]
        # A send may outlast its step: an answer that comes after the step's wait is still
        # settled, up to twice the wait (a link slow enough for more loses the share).
        transport = LibP2PTransport(
            self._p2p, self._swarm, self._compression, shapes, send_s=2 * self._wait_s
        )
        self._peer = GossipPeer(
            self.me, self._state, self._graph, transport, self._members,
            mode=self._mode, wait_s=self._wait_s, first_step=self._first_step,
        )  # fmt: skip
        await transport.serve(self._peer)
        await serve_state(self._p2p, self._swarm, self._snapshot)

    def _snapshot(self) -> GossipShare:
        """This peer's state for a coordinator's checkpoint (between mixes and steps)."""
        with self.lock:
            tensors = tuple(t.detach().clone() for t in self._state.tensors)
            return GossipShare(self._epoch(), self._state.weight, tensors)

    def fetch_state(self, peer: str, timeout_s: float) -> GossipShare:
        """``peer``'s state (a coordinator's checkpoint), within ``timeout_s`` or
        Unreachable; WireError when it serves none or a malformed one."""
        shapes = [t.shape for t in self._state.tensors]
        return fetch_one(self._loop, self._p2p, self._swarm, peer, shapes, timeout_s)

    def restore(self, state: GossipShare) -> None:
        """Start from ``state`` (a checkpoint): its parameters, and full weight."""
        with self.lock, torch.no_grad():
            for mine, saved in zip(self._state.tensors, state.tensors, strict=True):
                mine.copy_(saved)
            self._state.weight = 1.0

    def step(self, step: int) -> Future[StepReport]:
        """Gossip step ``step``, running on the gossip thread; done within ``wait_s``."""
        assert self._peer is not None, "start() first"
        return asyncio.run_coroutine_threadsafe(self._peer.gossip(step), self._loop)

    def close(self, close_s: float) -> None:
        """Answer held shares "nothing taken", stop serving and end the thread, within
        about ``close_s`` (what is still running then is left to end with the process)."""
        if self._thread.is_alive():
            done = asyncio.run_coroutine_threadsafe(self._close(close_s / 2), self._loop)
            try:
                done.result(timeout=close_s)
            except (TimeoutError, concurrent.futures.TimeoutError):
                log.warning("gossip did not stop within %.1f s; leaving it to the exit", close_s)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=close_s)

    async def _close(self, settle_s: float) -> None:
        """Stop serving, answer what is held, let streams in flight end (they are
        hivemind's: cancelling them logs errors), then drop the daemon connection."""
        if self._peer is not None:
            self._peer.close()
        if self._p2p is not None:
            await self._p2p.remove_protobuf_handler(
                handler_name(self._swarm), stream_input=True, stream_output=True
            )
            await self._p2p.remove_protobuf_handler(
                state_handler_name(self._swarm), stream_output=True
            )
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if others:
            await asyncio.wait(others, timeout=settle_s)
        if self._p2p is not None:
            await self._p2p.shutdown()  # a replica: its connection to the daemon, not the daemon


def _quiet_shutdown(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The gossip loop's exception handler: a stream cut short by this peer's own shutdown
    (a cancelled task, one left pending at exit) is routine, said at DEBUG; anything else is
    a WARNING, with what asyncio says of it."""
    error = context.get("exception")
    message = str(context.get("message", ""))
    if isinstance(error, asyncio.CancelledError) or message.startswith("Task was destroyed"):
        log.debug("gossip loop at shutdown: %s", message)
        return
    log.warning("gossip loop: %s (%r)", message, error)
