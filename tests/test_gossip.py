"""Gossip averaging's core (flotilla.p2p.gossip): the graphs every peer computes alike, and
push-sum, which keeps the network average exact when messages are lost. In one process:
the peers here are PushSum states and a loop that delivers (or drops) their shares."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from flotilla.core.errors import ConfigError, WireError
from flotilla.p2p.gossip import TOPOLOGIES, GossipShare, Graph, PushSum
from flotilla.p2p.gossip.consensus import consensus_distance, sketch

PEERS = [f"peer-{i:02d}" for i in range(8)]


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("n", [1, 2, 3, 8, 13])
def test_every_peer_sends_to_another_member_and_in_neighbours_mirror_out_neighbours(
    topology: str, n: int
) -> None:
    members = PEERS[:n] if n <= len(PEERS) else [f"p{i}" for i in range(n)]
    graph = Graph(topology, seed=3)
    for step in range(12):
        for peer in members:
            out = graph.out_neighbours(list(reversed(members)), peer, step)  # order-free
            assert len(out) == (1 if n > 1 else 0)
            assert peer not in out and set(out) <= set(members)
            for other in members:
                assert (other in out) == (peer in graph.in_neighbours(members, other, step))
    assert graph.out_neighbours(members, "not-a-member", 0) == ()


def test_the_exponential_graph_reaches_every_peer_within_log2_n_steps() -> None:
    """Peer i's parameters spread along i + 2**(t mod log2 n): after log2 n steps every peer
    has heard (indirectly) from every other."""
    for n in (2, 5, 8, 16, 20):
        members = [f"p{i:02d}" for i in range(n)]
        heard = {p: {p} for p in members}
        graph = Graph()
        for step in range(math.ceil(math.log2(n))):
            sent = {p: set(heard[p]) for p in members}
            for p in members:
                for q in graph.out_neighbours(members, p, step):
                    heard[q] |= sent[p]
        assert all(h == set(members) for h in heard.values()), n


def test_random_neighbours_are_the_same_for_every_peer_and_change_with_step_and_seed() -> None:
    a, b = Graph("random", seed=1), Graph("random", seed=1)
    draws = [a.out_neighbours(PEERS, PEERS[0], s) for s in range(20)]
    assert draws == [b.out_neighbours(PEERS, PEERS[0], s) for s in range(20)]
    assert len(set(draws)) > 3
    assert draws != [Graph("random", seed=2).out_neighbours(PEERS, PEERS[0], s) for s in range(20)]


def test_a_join_or_leave_changes_the_graph_at_once() -> None:
    graph = Graph("ring")
    assert graph.out_neighbours(PEERS[:3], PEERS[2], 0) == (PEERS[0],)
    assert graph.out_neighbours(PEERS[:4], PEERS[2], 0) == (PEERS[3],)  # a join
    assert graph.out_neighbours([PEERS[0], PEERS[2]], PEERS[2], 0) == (PEERS[0],)  # a leave


def test_an_unknown_topology_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="exponential, ring, random"):
        Graph("star")


def _gossip(
    states: dict[str, PushSum], graph: Graph, step: int, drop: float, rng: random.Random
) -> None:
    """One synchronous step: every peer shares, every share is delivered or dropped."""
    sends = []
    for peer, state in states.items():
        out = graph.out_neighbours(list(states), peer, step)
        share = state.share(step, len(out))
        if share is not None:
            sends += [(peer, target, share) for target in out]
    for peer, target, share in sends:
        delivered = rng.random() >= drop  # a dropped share is taken back whole
        states[peer].settle(share, states[target].take(share) if delivered else 0.0)


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("drop", [0.0, 0.3])
def test_push_sum_reaches_the_exact_average_when_a_share_of_messages_is_dropped(
    topology: str, drop: float
) -> None:
    gen = torch.Generator().manual_seed(0)
    params = {p: torch.randn(1000, generator=gen, dtype=torch.float64) for p in PEERS}
    mean = sum(params.values()) / len(PEERS)
    states = {p: PushSum([t]) for p, t in params.items()}
    rng = random.Random(7)
    for step in range(200):
        _gossip(states, Graph(topology, seed=5), step, drop, rng)
        weights = [s.weight for s in states.values()]
        mass = sum(w * params[p] for p, w in zip(PEERS, weights, strict=True)) / sum(weights)
        # Nothing lost on the way: the network average is exact at every step.
        assert float((mass - mean).abs().max()) < 1e-12 and sum(weights) == pytest.approx(8)
    spread = max(float((params[p] - mean).abs().max()) for p in PEERS)
    assert spread < 1e-4, spread


def _least_squares() -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(0)
    truth = rng.standard_normal(5)
    a = [rng.standard_normal((20, 5)) for _ in PEERS]
    b = [ai @ truth + 0.3 * rng.standard_normal(20) for ai in a]
    optimum = np.linalg.lstsq(np.vstack(a), np.concatenate(b), rcond=None)[0]
    return a, b, optimum


@pytest.mark.parametrize(("topology", "drop", "tolerance"), [
    ("exponential", 0.0, 1e-3), ("ring", 0.0, 1e-3), ("exponential", 0.3, 3e-3),
])  # fmt: skip
def test_gradient_push_converges_to_the_all_reduce_optimum_of_least_squares(
    topology: str, drop: float, tolerance: float
) -> None:
    """Each peer owns 20 rows of a least-squares problem; a gradient step on its own rows
    (scaled by 1 / weight: push-sum's numerator moves by the gradient), then a gossip step.
    All-reduce training converges to the optimum of all rows; so must gossip."""
    a, b, optimum = _least_squares()
    params = {p: torch.zeros(5, dtype=torch.float64) for p in PEERS}
    states = {p: PushSum([t]) for p, t in params.items()}
    rng = random.Random(1)
    for step in range(1000):
        lr = 0.5 * 0.99**step
        for i, peer in enumerate(PEERS):
            z = params[peer].numpy()
            grad = a[i].T @ (a[i] @ z - b[i]) / len(b[i])
            params[peer].sub_(torch.from_numpy(grad), alpha=lr / states[peer].weight)
        _gossip(states, Graph(topology), step, drop, rng)
    error = max(float(np.abs(params[p].numpy() - optimum).max()) for p in PEERS)
    assert error < tolerance, error


def test_a_malformed_share_is_refused_and_changes_nothing() -> None:
    model = [torch.ones(3, 2), torch.zeros(4)]
    state = PushSum(model)
    good = (torch.ones(3, 2), torch.ones(4))
    bad = {
        "shape": GossipShare(0, 0.5, (torch.ones(2, 3), torch.ones(4))),
        "count": GossipShare(0, 0.5, good[:1]),
        "NaN": GossipShare(0, 0.5, (torch.full((3, 2), math.nan), torch.ones(4))),
        "Inf": GossipShare(0, 0.5, (torch.ones(3, 2), torch.full((4,), math.inf))),
        "dtype": GossipShare(0, 0.5, (torch.ones(3, 2, dtype=torch.int64), torch.ones(4))),
        "weight": GossipShare(0, -1.0, good),
        "NaN weight": GossipShare(0, math.nan, good),
    }
    for name, share in bad.items():
        with pytest.raises(WireError):
            state.take(share)
        assert state.weight == 1.0, name
        assert torch.equal(model[0], torch.ones(3, 2)) and torch.equal(model[1], torch.zeros(4))


def test_a_share_claiming_a_huge_weight_pulls_a_peer_at_most_one_peers_weight() -> None:
    """Whatever a neighbour claims, a peer moves at most halfway (one lighter than 1, of
    weight w: 1 / (1 + w) of the way), and the answer says how much was taken."""
    for weight, expected in ((1.0, 5.0), (0.5, 20 / 3), (3.0, 5.0)):
        tensor = torch.zeros(4)
        state = PushSum([tensor], weight=weight)
        taken = state.take(GossipShare(0, 1e9, (torch.full((4,), 10.0),)))
        assert taken == max(weight, 1.0) and state.weight == weight + taken
        assert torch.allclose(tensor, torch.full((4,), expected))


def test_settling_a_share_is_exact_whatever_was_mixed_in_meanwhile() -> None:
    """A peer shares (its weight set aside), takes a neighbour's share, then learns what of
    its own was taken: what comes back is the mass it sent, not what it holds now."""
    mine, theirs = (
        torch.tensor([1.0, 2.0], dtype=torch.float64),
        torch.tensor([5.0, 7.0], dtype=torch.float64),
    )
    a, b = PushSum([mine]), PushSum([theirs])
    before = mine + theirs
    sent = a.share(0, parts=2)  # two neighbours: a keeps a third until they answer
    assert sent is not None and a.weight == pytest.approx(1 / 3)
    back = b.share(0)
    assert back is not None
    b.settle(back, a.take(back))  # a mixes b's share in before its own is answered
    a.settle(sent, b.take(sent))
    a.settle(sent, 0.0)  # the second neighbour never answered: its part comes back whole
    assert a.weight + b.weight == pytest.approx(2.0)
    assert torch.allclose(a.weight * mine + b.weight * theirs, before)


def test_a_share_whose_answer_was_lost_is_taken_back_out_exactly() -> None:
    """A receiver that mixed a share in but could not answer gives it back (its sender takes
    the weight back too), even after it trained and mixed more meanwhile."""
    mine = torch.tensor([1.0, 2.0], dtype=torch.float64)
    theirs = torch.tensor([5.0, 7.0], dtype=torch.float64)
    a, b = PushSum([mine]), PushSum([theirs])
    sent = b.share(0)
    assert sent is not None
    taken = a.take(sent)
    mine.add_(0.25)  # a local step, in z: the mass moves by w * 0.25
    a.take(GossipShare(1, 0.5, (torch.tensor([3.0, 3.0], dtype=torch.float64),)))
    mass = a.weight * mine
    assert a.untake(sent, taken)
    b.settle(sent, 0.0)
    assert a.weight + b.weight == pytest.approx(2.5)
    assert torch.allclose(a.weight * mine, mass - taken * sent.tensors[0])
    assert torch.allclose(theirs, torch.tensor([5.0, 7.0], dtype=torch.float64))
    # Too light to give it back: refused, nothing changes.
    light = PushSum([torch.zeros(2)], weight=0.5)
    assert not light.untake(sent, 0.5) and light.weight == 0.5


def test_a_peer_with_almost_no_weight_left_waits_to_receive_before_sharing_again() -> None:
    state = PushSum([torch.zeros(2)], weight=1e-7)
    assert state.share(0) is None
    state.take(GossipShare(0, 0.3, (torch.ones(2),)))
    assert state.share(1) is not None


def test_the_graphs_are_the_ones_docs_p2p_protocol_writes_down() -> None:
    """Another implementation computes the same neighbours from docs/p2p-protocol.md."""
    members = sorted(PEERS)
    n = len(members)
    for step in range(10):
        for i, peer in enumerate(members):
            hop = 2 ** (step % math.ceil(math.log2(n)))
            assert Graph().out_neighbours(members, peer, step) == (members[(i + hop) % n],)
            assert Graph("ring").out_neighbours(members, peer, step) == (members[(i + 1) % n],)
            others = [m for m in members if m != peer]
            r = random.Random(f"7:{step}:{peer}").randrange(n - 1)
            assert Graph("random", seed=7).out_neighbours(members, peer, step) == (others[r],)


def test_sketches_estimate_the_consensus_distance_without_the_models() -> None:
    """Peers publish 32-float sketches (seeded random projections); the distance computed
    from them estimates the true one within the Johnson-Lindenstrauss error."""
    gen = torch.Generator().manual_seed(3)
    centre = [torch.randn(200, 50, generator=gen), torch.randn(50, generator=gen)]
    models = [
        [c + spread * torch.randn(c.shape, generator=gen) for c in centre]
        for spread in (0.01, 0.02, 0.05, 0.1)
    ]
    flat = [torch.cat([t.reshape(-1) for t in m]).tolist() for m in models]
    truth = consensus_distance(flat)
    estimate = consensus_distance([sketch(m, seed=11) for m in models])
    assert truth > 0 and abs(estimate - truth) < 0.5 * truth, (estimate, truth)
    assert sketch(models[0], seed=11) == sketch(models[0], seed=11)  # every peer alike
    assert consensus_distance([sketch(models[0], seed=11)] * 3) == pytest.approx(0.0, abs=1e-9)
    assert consensus_distance([]) == 0.0
