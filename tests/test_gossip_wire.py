"""Gossip shares over real hivemind peers (two DHT nodes and their libp2p daemons on
127.0.0.1, in this process): shares mix, answers carry the weight taken, and a share that
does not fit is refused on the wire with nothing taken."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch
from hivemind.compression import NoCompression
from hivemind.proto.averaging_pb2 import DownloadData

from flotilla.core.errors import Unreachable, WireError
from flotilla.p2p import start_dht
from flotilla.p2p.codecs import hivemind_compression
from flotilla.p2p.dht import visible_maddrs
from flotilla.p2p.gossip import GossipShare, Graph, PushSum
from flotilla.p2p.gossip.peer import GossipPeer
from flotilla.p2p.gossip.wire import LibP2PTransport, read_share, share_messages

pytestmark = [pytest.mark.xdist_group(__name__), pytest.mark.timeout(180)]

SHAPES = (torch.Size([300, 40]), torch.Size([40]))
#: Gossip steps of the runner test: 3 peers in step halve their spread each step.
STEPS = 32


@pytest.fixture
def dhts() -> Iterator[list[Any]]:
    first = start_dht()
    second = start_dht(visible_maddrs(first))
    try:
        yield [first, second]
    finally:
        for dht in (first, second):
            dht.shutdown()


def _model(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in SHAPES]


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_two_peers_mix_over_libp2p_to_their_average(dhts: list[Any], compression: str) -> None:
    models = [_model(0), _model(1)]
    mean = [(a + b) / 2 for a, b in zip(*models, strict=True)]
    ids = [str(d.peer_id) for d in dhts]

    async def main() -> None:
        peers = []
        for dht, me, model in zip(dhts, ids, models, strict=True):
            p2p = await dht.replicate_p2p()
            codec = hivemind_compression(compression)
            transport = LibP2PTransport(p2p, "wiretest", codec, SHAPES, send_s=20.0)
            peer = GossipPeer(me, PushSum(model), Graph(), transport, lambda: ids, wait_s=10.0)
            await transport.serve(peer)
            peers.append(peer)
        reports = await asyncio.gather(*(p.gossip(0) for p in peers))
        for report, other in zip(reports, reversed(ids), strict=True):
            assert report.taken_by == (other,) and report.mixed_from == (other,)

    asyncio.run(main())
    tolerance = 1e-6 if compression == "none" else 0.05  # int8: a step of 1/127 of absmax
    for model in models:
        for tensor, target in zip(model, mean, strict=True):
            assert torch.allclose(tensor, target, atol=tolerance)


def test_a_share_of_another_model_is_refused_on_the_wire_and_nothing_is_taken(
    dhts: list[Any],
) -> None:
    ids = [str(d.peer_id) for d in dhts]
    receiver_model = _model(0)
    before = [t.clone() for t in receiver_model]

    async def main() -> None:
        p2p_a, p2p_b = [await d.replicate_p2p() for d in dhts]
        serving = LibP2PTransport(p2p_b, "wiretest", NoCompression(), SHAPES, send_s=10.0)
        receiver = GossipPeer(ids[1], PushSum(receiver_model), Graph(), serving, lambda: ids,
                              mode="async", wait_s=5.0)  # fmt: skip
        await serving.serve(receiver)
        sending = LibP2PTransport(p2p_a, "wiretest", NoCompression(), SHAPES, send_s=10.0)
        wrong = GossipShare(0, 0.5, (torch.zeros(300, 41), torch.zeros(40)))
        with pytest.raises(Unreachable, match="shape"):
            await sending.send(ids[1], wrong, 1.0)
        nan = GossipShare(0, 0.5, (torch.full((300, 40), float("nan")), torch.zeros(40)))
        with pytest.raises(Unreachable, match="NaN"):
            await sending.send(ids[1], nan, 1.0)

    asyncio.run(main())
    assert all(torch.equal(a, b) for a, b in zip(receiver_model, before, strict=True))


async def _stream(messages: list[DownloadData]) -> AsyncIterator[DownloadData]:
    for message in messages:
        yield message


def test_a_stream_larger_than_the_model_or_with_a_bad_header_is_refused() -> None:
    share = GossipShare(3, 0.5, tuple(torch.ones(s) for s in SHAPES))
    messages = share_messages(share, NoCompression(), 2.5)
    decoded, hold_s = asyncio.run(read_share(_stream(messages), SHAPES, 5.0))
    assert hold_s == 2.5
    assert decoded.step == 3 and decoded.weight == 0.5
    assert all(torch.equal(a, b) for a, b in zip(decoded.tensors, share.tensors, strict=True))

    padded = messages + messages[1:] * 3  # the same tensors again: more than the model needs
    with pytest.raises(WireError, match="more than this model needs"):
        asyncio.run(read_share(_stream(padded), SHAPES, 5.0))
    bad_headers: list[Any] = [
        b"not json",
        json.dumps({"version": 2, "step": 0, "weight": 1.0, "hold_s": 1, "tensors": 2}),
        json.dumps({"version": 1, "step": -1, "weight": 1.0, "hold_s": 1, "tensors": 2}),
        json.dumps({"version": 1, "step": 0, "weight": "1", "hold_s": 1, "tensors": 2}),
        json.dumps({"version": 1, "step": 0, "weight": 1.0, "hold_s": 1, "tensors": 2, "x": 1}),
        json.dumps({"version": 1, "step": 0, "weight": 1.0, "hold_s": 1, "tensors": 3}),
        json.dumps({"version": 1, "step": 0, "weight": 1.0, "tensors": 2}),
    ]
    for header in bad_headers:
        raw = header if isinstance(header, bytes) else header.encode()
        with pytest.raises(WireError):
            asyncio.run(
                read_share(_stream([DownloadData(metadata=raw), *messages[1:]]), SHAPES, 5.0)
            )


@pytest.mark.parametrize("delayed", [False, True])
def test_three_runners_beside_training_threads_agree(
    delayed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Three peers, each a training thread with its gossip on a thread of its own. With
    delayed averaging a step's shares travel while the next step computes (its future is
    collected one step later); either way the peers end at the average."""
    from flotilla.p2p.gossip.runner import GossipRunner

    caplog.set_level(logging.DEBUG, logger="flotilla.p2p.gossip")
    first = start_dht()
    others = [start_dht(visible_maddrs(first)) for _ in range(2)]
    dhts = [first, *others]
    ids = [str(d.peer_id) for d in dhts]
    models = [_model(i) for i in range(3)]
    mean = [sum(ts) / 3 for ts in zip(*models, strict=True)]
    runners = []
    reports: list[Any] = []
    try:
        for dht, model in zip(dhts, models, strict=True):
            runner = GossipRunner(
                dht, "runnertest", model, lambda: ids,
                graph=Graph(), compression=NoCompression(), mode="sync", wait_s=10.0,
            )  # fmt: skip
            runners.append(runner.start(start_s=30))

        def train(runner: GossipRunner) -> None:
            pending = None
            for step in range(STEPS):
                with runner.lock:  # a local step would change the parameters here
                    pass
                future = runner.step(step)
                future.add_done_callback(lambda f: reports.append(f.result()))
                if delayed:
                    if pending is not None:
                        pending.result(timeout=30)
                    pending = future
                else:
                    future.result(timeout=30)
            if pending is not None:
                pending.result(timeout=30)

        threads = [threading.Thread(target=train, args=(r,)) for r in runners]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        # Shares are taken (a loaded machine may time out a few: they only slow the mixing).
        sent = sum(len(r.sent_to) for r in reports)
        taken = sum(len(r.taken_by) for r in reports)
        assert len(reports) == 3 * STEPS and taken >= 0.9 * sent, (taken, sent, caplog.text)
        # Answers that came after their step are settled when they come (bounded waits).
        settle_by = time.monotonic() + 30
        while any(r.unsettled for r in runners) and time.monotonic() < settle_by:
            time.sleep(0.05)
        # Exact, but for shares whose answer a stream lost (the sender counts them).
        uncertain = sum(r.uncertain for r in runners)
        assert abs(sum(r.weight for r in runners) - 3.0) <= uncertain + 1e-6, caplog.text
        assert uncertain <= 0.05 * sent, caplog.text  # rare: a stream that died mid-answer
        spread = max(
            float((t - m).abs().max()) for ts in models for t, m in zip(ts, mean, strict=True)
        )
        assert spread < 1e-4, (spread, caplog.text)
    finally:
        for runner in runners:
            runner.close(close_s=10)
        for dht in dhts:
            dht.shutdown()


def test_a_sender_that_stalls_mid_share_is_dropped_after_the_idle_time() -> None:
    share = GossipShare(0, 0.5, tuple(torch.ones(s) for s in SHAPES))
    messages = share_messages(share, NoCompression(), 1.0)

    async def stalled() -> AsyncIterator[DownloadData]:
        yield messages[0]
        yield messages[1]
        await asyncio.sleep(3600)  # a slow-loris: holds the handler, sends nothing

    with pytest.raises(WireError, match="stalled"):
        asyncio.run(read_share(stalled(), SHAPES, 0.2))


def test_a_coordinator_fetches_members_states_and_serves_its_checkpoint(
    dhts: list[Any],
) -> None:
    """The state a gossip peer serves (parameters, push-sum weight, epoch) reaches a
    coordinator exactly; the weighted mean of states is push-sum's network average; a
    coordinator serves nothing before its first checkpoint, and its checkpoint after; a
    state of another model is refused."""
    from flotilla.p2p.gossip.runner import GossipRunner
    from flotilla.p2p.gossip.state import StateService, mean_state

    member, coordinator = dhts
    model = _model(0)
    epoch = [7]
    runner = GossipRunner(
        member, "statetest", model, lambda: [str(member.peer_id)],
        graph=Graph(), compression=NoCompression(), mode="sync", wait_s=5.0,
        weight=0.75, epoch=lambda: epoch[0],
    ).start(start_s=30)  # fmt: skip
    service = StateService(coordinator, "statetest", SHAPES).start(start_s=30)
    other = StateService(member, "othermodel", [torch.Size([3])]).start(start_s=30)
    try:
        state = service.fetch(str(member.peer_id), timeout_s=20)
        assert (state.step, state.weight) == (7, 0.75)
        for got, want in zip(state.tensors, model, strict=True):
            assert torch.equal(got, want)

        lighter = GossipShare(9, 0.25, tuple(2 * t for t in model))
        mean = mean_state([state, lighter])  # (0.75 z + 0.25 * 2z) / 1 = 1.25 z
        assert (mean.step, mean.weight) == (9, 1.0)
        for got, want in zip(mean.tensors, model, strict=True):
            assert torch.allclose(got, 1.25 * want)
        # A state claiming more than one peer's weight counts as one: (0.75 z + 2z) / 1.75
        boastful = mean_state([state, GossipShare(9, 1e9, tuple(2 * t for t in model))])
        assert torch.allclose(boastful.tensors[0], (2.75 / 1.75) * model[0])

        with pytest.raises(WireError, match="no state"):
            runner.fetch_state(str(coordinator.peer_id), timeout_s=20)
        service.offer(GossipShare(12, 1.0, tuple(mean.tensors)))
        resumed = runner.fetch_state(str(coordinator.peer_id), timeout_s=20)
        assert resumed.step == 12
        runner.restore(resumed)
        assert runner.weight == 1.0 and torch.allclose(model[0], 1.25 * _model(0)[0])

        other.offer(GossipShare(1, 1.0, (torch.ones(3),)))  # a model of other shapes
        wrong = StateService(coordinator, "othermodel", SHAPES).start(start_s=30)
        try:
            with pytest.raises(WireError):
                wrong.fetch(str(member.peer_id), timeout_s=20)
        finally:
            wrong.close(close_s=5)
        gone = start_dht()
        gone_id = str(gone.peer_id)
        gone.shutdown()
        with pytest.raises(Unreachable):
            service.fetch(gone_id, timeout_s=5)
        # Fetched at once: each peer's state, or why not.
        both = service.fetch_all([str(member.peer_id), gone_id], timeout_s=5)
        assert isinstance(both[0], GossipShare) and both[0].step == 7
        assert isinstance(both[1], Unreachable)
    finally:
        other.close(close_s=5)
        service.close(close_s=5)
        runner.close(close_s=5)
