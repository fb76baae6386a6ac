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
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from hivemind.compression import CompressionBase

from flotilla.p2p.gossip.graph import Graph
from flotilla.p2p.gossip.peer import GossipPeer, StepReport
from flotilla.p2p.gossip.pushsum import PushSum
from flotilla.p2p.gossip.wire import LibP2PTransport, handler_name


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
    ) -> None:
        self._dht, self._swarm, self._members = dht, swarm, members
        self._state = PushSum(tensors)
        self._graph, self._compression, self._mode, self._wait_s = graph, compression, mode, wait_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gossip", daemon=True)
        self._peer: GossipPeer | None = None
        self._p2p: Any = None

    @property
    def me(self) -> str:
        return str(self._dht.peer_id)

    @property
    def weight(self) -> float:
        return self._state.weight

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
            mode=self._mode, wait_s=self._wait_s,
        )  # fmt: skip
        await transport.serve(self._peer)

    def step(self, step: int) -> Future[StepReport]:
        """Gossip step ``step``, running on the gossip thread; done within ``wait_s``."""
        assert self._peer is not None, "start() first"
        return asyncio.run_coroutine_threadsafe(self._peer.gossip(step), self._loop)

    def close(self, close_s: float) -> None:
        """Answer held shares "nothing taken", stop serving and end the thread."""
        if self._thread.is_alive():
            done = asyncio.run_coroutine_threadsafe(self._close(), self._loop)
            try:
                done.result(timeout=close_s)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=close_s)

    async def _close(self) -> None:
        if self._peer is not None:
            self._peer.close()
        if self._p2p is not None:
            await self._p2p.remove_protobuf_handler(
                handler_name(self._swarm), stream_input=True, stream_output=True
            )
            await self._p2p.shutdown()  # a replica: its connection to the daemon, not the daemon
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
