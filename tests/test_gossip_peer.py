"""Gossiping peers (flotilla.p2p.gossip.GossipPeer) on an in-process transport that delays,
drops and kills: what the protocol promises, without the network (the libp2p wire has its
own tests). Every peer runs its own step loop concurrently on one asyncio loop."""

from __future__ import annotations

import asyncio
import logging
import random
import time

import pytest
import torch

from flotilla.core.errors import Unreachable, UpdateRejected
from flotilla.p2p.gossip import GossipShare, Graph, PushSum
from flotilla.p2p.gossip.peer import GossipPeer

PEERS = [f"peer-{i}" for i in range(8)]


class Network:
    """Peers by name; a share is dropped with probability ``drop`` before it arrives (the
    sender sees an error) and takes up to ``delay_s`` on the way."""

    def __init__(
        self, drop: float = 0.0, delay_s: float = 0.002, seed: int = 0, goodbyes: bool = True
    ) -> None:
        """``goodbyes``: a dead peer leaves the membership at once (else it stays)."""
        self.peers: dict[str, GossipPeer] = {}
        self.dead: set[str] = set()
        self.goodbyes = goodbyes
        self.drop, self.delay_s = drop, delay_s
        self.rng = random.Random(seed)

    def transport(self, me: str) -> Link:
        return Link(self, me)

    def members(self) -> list[str]:
        return [p for p in self.peers if not (self.goodbyes and p in self.dead)]


class Link:
    def __init__(self, network: Network, me: str) -> None:
        self.network, self.me = network, me

    async def send(self, peer: str, share: GossipShare, hold_s: float) -> float:
        net = self.network
        await asyncio.sleep(net.rng.uniform(0, net.delay_s))
        if peer in net.dead or self.me in net.dead or net.rng.random() < net.drop:
            raise Unreachable(f"{peer} did not answer")
        return await net.peers[peer].receive(self.me, share, hold_s)


def _swarm(
    network: Network, mode: str, wait_s: float = 1.0, topology: str = "exponential"
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = {p: torch.randn(64, generator=gen, dtype=torch.float64) for p in PEERS}
    for peer, tensor in params.items():
        network.peers[peer] = GossipPeer(
            peer,
            PushSum([tensor]),
            Graph(topology, seed=1),
            network.transport(peer),
            network.members,
            mode=mode,
            wait_s=wait_s,
        )
    return params


def _mass_average(network: Network, params: dict[str, torch.Tensor]) -> torch.Tensor:
    alive = network.members()
    weights = {p: network.peers[p].state.weight for p in alive}
    return sum(weights[p] * params[p] for p in alive) / sum(weights.values())


async def _run(network: Network, peer: str, steps: int, pause_s: float = 0.0) -> list[float]:
    """A peer's loop: ``steps`` gossip steps (after a local step of ``pause_s``); each
    step's wall time."""
    took = []
    for step in range(steps):
        if peer in network.dead:
            break
        await asyncio.sleep(pause_s)
        began = time.monotonic()
        await network.peers[peer].gossip(step)
        took.append(time.monotonic() - began)
    return took


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("drop", [0.0, 0.3])
def test_peers_reach_the_exact_average_with_messages_lost(mode: str, drop: float) -> None:
    network = Network(drop=drop)
    params = _swarm(network, mode, wait_s=0.1)
    mean = sum(params.values()) / len(params)

    async def main() -> None:
        # async: peers at different paces, so shares land at any step of the receiver.
        pauses = {p: (0.001 * (i % 3) if mode == "async" else 0.0) for i, p in enumerate(PEERS)}
        await asyncio.gather(*(_run(network, p, 120, pauses[p]) for p in PEERS))
        for peer in network.peers.values():
            peer.close()

    asyncio.run(main())
    # Nothing double-counted, nothing lost: the network's mass average is the mean.
    assert torch.allclose(_mass_average(network, params), mean, atol=1e-12)
    assert sum(p.state.weight for p in network.peers.values()) == pytest.approx(len(PEERS))
    spread = max(float((params[p] - mean).abs().max()) for p in PEERS)
    assert spread < 1e-2, spread  # from about 3: how close after 120 steps depends on timing


@pytest.mark.timeout(60)
def test_in_sync_mode_both_sides_of_every_edge_mix_the_same_step() -> None:
    """Without losses, synchronous exponential gossip is exact averaging over log2 n steps:
    8 peers agree to rounding after 3 steps (each mixing its in-neighbour of that step)."""
    network = Network()
    params = _swarm(network, "sync")
    mean = sum(params.values()) / len(params)

    async def main() -> None:
        await asyncio.gather(*(_run(network, p, 3) for p in PEERS))

    asyncio.run(main())
    assert max(float((params[p] - mean).abs().max()) for p in PEERS) < 1e-12
    assert all(p.state.weight == pytest.approx(1.0) for p in network.peers.values())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_peer_killed_mid_run_stalls_no_survivor_beyond_the_wait(mode: str) -> None:
    network = Network()
    params = _swarm(network, mode, wait_s=0.2)
    victim = PEERS[3]

    async def kill_later() -> None:
        await asyncio.sleep(0.05)
        network.dead.add(victim)  # gone from the DHT's membership, and its link dead

    async def main() -> list[list[float]]:
        killer = asyncio.ensure_future(kill_later())
        times = await asyncio.gather(*(_run(network, p, 40, 0.002) for p in PEERS))
        await killer
        return [t for p, t in zip(PEERS, times, strict=True) if p != victim]

    survivors = asyncio.run(main())
    # A step waits at most for its neighbours (wait_s) plus its own sends (wait_s).
    assert max(max(t) for t in survivors) < 2 * 0.2 + 0.2
    alive = [p for p in PEERS if p != victim]
    centre = _mass_average(network, params)
    spread = max(float((params[p] - centre).abs().max()) for p in alive)
    assert spread < 1e-3, spread  # the survivors still agree


@pytest.mark.timeout(60)
def test_a_peer_killed_without_a_goodbye_costs_each_neighbour_one_wait() -> None:
    """A sync peer waits half a wait for an in-neighbour's share; one killed without a
    goodbye stays a member (until its metrics grow old): each survivor waits for it once,
    then mixes on (its shares are mixed as they come, should it be only slow)."""
    wait_s = 0.4
    network = Network(goodbyes=False)  # the victim stays a member
    params = _swarm(network, "sync", wait_s=wait_s)
    victim = PEERS[3]
    network.dead.add(victim)

    async def main() -> list[list[float]]:
        times = await asyncio.gather(*(_run(network, p, 24) for p in PEERS if p != victim))
        for peer in network.peers.values():
            peer.close()
        return times

    for took in asyncio.run(main()):
        waited = [t for t in took if t >= 0.8 * wait_s / 2]
        assert len(waited) <= 1, took  # 24 steps: the victim is an in-neighbour 8 times
    alive = [p for p in PEERS if p != victim]
    centre = sum(network.peers[p].state.weight * params[p] for p in alive) / sum(
        network.peers[p].state.weight for p in alive
    )
    assert max(float((params[p] - centre).abs().max()) for p in alive) < 1e-3


@pytest.mark.timeout(30)
def test_a_share_from_outside_the_run_is_refused_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    network = Network()
    params = _swarm(network, "async")
    before = params[PEERS[0]].clone()
    stranger = GossipShare(0, 0.5, (torch.zeros(64, dtype=torch.float64),))

    async def main() -> None:
        for _ in range(3):
            with pytest.raises(UpdateRejected, match="not a member"):
                await network.peers[PEERS[0]].receive("intruder", stranger, 1.0)

    with caplog.at_level(logging.WARNING, logger="flotilla.p2p.gossip.peer"):
        asyncio.run(main())
    assert torch.equal(params[PEERS[0]], before)
    assert network.peers[PEERS[0]].state.weight == 1.0
    assert sum("intruder" in r.getMessage() for r in caplog.records) == 1
    assert network.peers[PEERS[0]].strangers == 3  # its owner may read the members again


@pytest.mark.timeout(30)
def test_a_share_for_a_step_never_reached_is_answered_nothing_taken() -> None:
    """In sync mode a share waits for its step; if the receiver never gets there within the
    wait, the sender keeps its weight (it is told nothing was taken)."""
    network = Network()
    params = _swarm(network, "sync", wait_s=0.1)
    receiver, sender = network.peers[PEERS[0]], network.peers[PEERS[1]]

    async def main() -> float:
        share = sender.state.share(5)
        assert share is not None
        return await receiver.receive(PEERS[1], share, 1.0)

    assert asyncio.run(main()) == 0.0
    assert receiver.state.weight == 1.0 and torch.isfinite(params[PEERS[0]]).all()


@pytest.mark.timeout(30)
def test_a_share_for_a_far_future_step_is_not_kept_once_its_hold_ends() -> None:
    network = Network()
    _swarm(network, "sync", wait_s=0.05)
    receiver, sender = network.peers[PEERS[0]], network.peers[PEERS[1]]

    async def main() -> list[float]:
        shares = [sender.state.share(10**9 + i) for i in range(20)]
        return await asyncio.gather(*(receiver.receive(PEERS[1], s, 1.0) for s in shares if s))

    assert asyncio.run(main()) == [0.0] * 20
    assert receiver.held == 0  # nothing pins their tensors


@pytest.mark.timeout(30)
def test_a_held_share_mixed_as_its_sender_hangs_up_is_held_once() -> None:
    """The receiver reaches the step of a held share and mixes it just as the sender hangs
    up. Either the answer still comes back (the sender keeps what it says was taken) or the
    hang-up wins (the sender takes its weight back, and the receiver takes the share back
    out): whichever, the network holds the share once."""
    network = Network()
    params = _swarm(network, "sync", wait_s=1.0)
    receiver, sender = network.peers[PEERS[0]], network.peers[PEERS[1]]
    mass = sum(params[p] * network.peers[p].state.weight for p in PEERS[:2])

    async def main() -> None:
        share = sender.state.share(0)
        assert share is not None
        held = asyncio.create_task(receiver.receive(PEERS[1], share, 1.0))
        await asyncio.sleep(0.01)
        assert receiver.held == 1
        receiver._mix_early(0)  # the receiver reaches step 0: the share is mixed ...
        held.cancel()  # ... and its sender hangs up
        try:
            taken = await held
        except asyncio.CancelledError:
            taken = 0.0  # no answer: the share was taken back out
        sender.state.settle(share, taken)  # what the sender's send does with the answer

    asyncio.run(main())
    weights = {p: network.peers[p].state.weight for p in PEERS[:2]}
    assert sum(weights.values()) == pytest.approx(2.0)
    after = sum(params[p] * weights[p] for p in PEERS[:2])
    assert torch.allclose(after, mass, atol=1e-12)
