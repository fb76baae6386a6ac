"""A volunteer's optimizer in a gossip run (``averaging = "gossip"``): local torch steps,
and after every epoch's share of samples one push-sum step with a neighbour
(:mod:`flotilla.p2p.gossip`), instead of hivemind's group rounds.

It shows the volunteer's loop the face of the run's hivemind optimizer (``step``,
``zero_grad``, ``local_epoch``, ``averaged_epochs``, ``leave``...), so one loop trains
both. An epoch is ``target_batch_size`` samples over the swarm, as in group runs: each
peer gossips after ``target_batch_size / members`` of its own. ``sync`` waits for the
epoch's mixing before the next local step; ``async`` is delayed averaging that never waits:
an epoch's shares travel while the next epochs compute, and a new gossip step starts at
the first epoch end after the last one ended (one step in flight; a share is as stale as
its trip is long, bounded by twice ``gossip_wait``). The optimizer's own state (Adam's
moments) stays local; mixing changes the parameters only.

Neighbours are the peers that published metrics for the run in the last
:data:`~flotilla.p2p.dht.ONLINE_S` seconds, read from the DHT at most every
:data:`MEMBERS_EVERY_S`. A peer joining a run that has made progress joins light (push-sum
weight :data:`JOIN_WEIGHT`): its first mix all but replaces its fresh parameters with its
neighbour's, and its own shares barely move anyone until it has caught up.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import hivemind
import torch

from flotilla.core.errors import FlotillaError
from flotilla.core.lifetime import WAKE_EVERY_S
from flotilla.core.timeouts import Timeouts
from flotilla.p2p.codecs import hivemind_compression
from flotilla.p2p.dht import ONLINE_S, PeerMetrics, publish_metrics, read_metrics, read_status
from flotilla.p2p.gossip import Graph
from flotilla.p2p.gossip.consensus import sketch
from flotilla.p2p.gossip.peer import StepReport
from flotilla.p2p.gossip.runner import GossipRunner
from flotilla.p2p.record import RunRecord

log = logging.getLogger(__name__)

#: Seconds between reads of the run's membership from the DHT.
MEMBERS_EVERY_S = 2.0
#: The push-sum weight of a peer joining a run in progress (a fresh peer weighs 1).
JOIN_WEIGHT = 1e-3
#: How often a joining peer looks whether a neighbour's share has arrived.
JOIN_POLL_S = 0.1
#: Seconds between sketches of the parameters (one costs a few hundred ms per 100k
#: parameters on a laptop core).
SKETCH_EVERY_S = 10.0


def local_optimizer(record: RunRecord) -> Any:
    """The record's torch optimizer, as a factory of parameters."""
    if record.optimizer == "adam":
        return partial(torch.optim.Adam, lr=record.learning_rate)
    return partial(torch.optim.SGD, lr=record.learning_rate, momentum=0.9)


class Membership:
    """The run's current members (base58 peer ids, this peer among them), as the gossip
    graph wants them: a cached tuple, read from the peers' metrics in the DHT on a thread of
    its own (a DHT read over a slow link takes seconds: the training thread never waits
    for one)."""

    def __init__(self, dht: hivemind.DHT, run: str, background: ThreadPoolExecutor) -> None:
        """``background``: where reads run (a thread the training thread does not wait on)."""
        self._dht, self._run, self.me = dht, run, str(dht.peer_id)
        self._members: tuple[str, ...] = (self.me,)
        self._read_at = -math.inf
        self._reader = background
        self._reading: Future[None] | None = None
        #: The highest epoch another member reported at the last read.
        self.epoch = 0

    def __call__(self) -> tuple[str, ...]:
        return self._members

    def read(self) -> None:
        """Read the members now, and wait for it (a peer's start)."""
        self._read_at = time.monotonic()
        self._read()

    def refresh(self, force: bool = False) -> None:
        """Read the members again in the background, at most every
        :data:`MEMBERS_EVERY_S` unless ``force``; one read at a time."""
        if self._reading is not None and not self._reading.done():
            return
        if not force and time.monotonic() - self._read_at < MEMBERS_EVERY_S:
            return
        self._read_at = time.monotonic()
        self._reading = self._reader.submit(self._read)

    def _read(self) -> None:
        try:
            metrics = read_metrics(self._dht, self._run)
        except Exception as exc:  # a DHT hiccup: keep the members we had
            log.warning("could not read the run's members: %s", exc)
            return
        now = time.time()
        fresh = [m for m in metrics if now - m.time <= ONLINE_S and not m.auxiliary]
        members = tuple(sorted({self.me, *(m.peer for m in fresh)}))
        if members != self._members:
            log.info("gossip members: %d (%s)", len(members), ", ".join(p[-6:] for p in members))
        self._members = members
        self.epoch = max((m.epoch for m in fresh if m.peer != self.me), default=0)


class GossipOptimizer:
    """A gossip run's volunteer optimizer; constructing it joins the run's gossip (serves
    shares, announces this peer), :meth:`shutdown` leaves it."""

    def __init__(
        self,
        dht: hivemind.DHT,
        record: RunRecord,
        model: torch.nn.Module,
        *,
        batch_size: int,
    ) -> None:
        self._record, self._batch_size = record, batch_size
        params = [p for p in model.parameters() if p.requires_grad]
        self._opt = local_optimizer(record)(params)
        self._dht = dht
        #: DHT reads and sketches: off the training thread.
        self._background = ThreadPoolExecutor(1, thread_name_prefix="gossip-background")
        self.members = Membership(dht, record.run, self._background)
        self.members.read()
        self._joining = self.members.epoch > 0
        #: The gossip step this peer is at: every member counts the same epochs.
        self.local_epoch = self.members.epoch
        self.averaged_epochs = 0
        self._samples = 0
        self._pending: Future[StepReport] | None = None
        self._strangers = 0
        self._params = params
        self._sketch: list[float] | None = None
        self._sketched_at = -math.inf
        self._neighbours: list[str] = []
        self._runner = GossipRunner(
            dht, record.swarm, [p.detach() for p in params], self.members,
            graph=Graph(record.gossip_topology, seed=record.seed),
            compression=hivemind_compression(record.compression),
            mode=record.gossip_mode, wait_s=record.gossip_wait,
            weight=JOIN_WEIGHT if self._joining else 1.0, first_step=self.local_epoch,
            epoch=lambda: self.local_epoch,
        )  # fmt: skip
        self._runner.start(start_s=Timeouts().dht_start_s)
        self._closed = threading.Event()
        self._announce()

    def _announce(self, leaving: bool = False) -> None:
        """Metrics with no steps yet: the other members count this peer as a neighbour
        from their next read, before its first step has published any. Leaving, metrics
        stamped at time 0, which no member counts as fresh: they stop sending to it."""
        hello = PeerMetrics(
            peer=self.members.me, epoch=self.local_epoch, steps=0, samples=0,
            samples_per_second=0.0, loss=None, time=0.0 if leaving else time.time(),
        )  # fmt: skip
        try:
            publish_metrics(self._dht, self._record.run, hello)
        except Exception as exc:  # the others notice when its metrics grow old
            log.warning(
                "could not tell the run this peer %s: %s", "leaves" if leaving else "joins", exc
            )

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Hold while a forward and backward pass read the parameters: mixing changes them
        in place, and waits for this."""
        with self._runner.lock:
            yield

    def sketch(self) -> list[float] | None:
        """The parameters' last sketch for this peer's metrics (None before the first);
        drawn every :data:`SKETCH_EVERY_S` in the background, reading the parameters
        without holding off training or mixing (either meanwhile blurs one estimate)."""
        if time.monotonic() - self._sketched_at >= SKETCH_EVERY_S:
            self._sketched_at = time.monotonic()
            self._background.submit(self._draw_sketch)
        return self._sketch

    def _draw_sketch(self) -> None:
        try:
            self._sketch = sketch(self._params, seed=self._record.seed)
        except Exception as exc:  # a sketch is for status only: say so, train on
            log.warning("could not sketch the parameters: %r", exc)

    def neighbours(self) -> list[str]:
        """The peers this one mixed with at its last gossip step (sent a share one took,
        or mixed one's share)."""
        return list(self._neighbours)

    def load_state_from_peers(self) -> None:
        """A peer joining a run in progress joins light and waits for its first mix, which
        brings it its neighbours' parameters (at most two gossip waits and two membership
        reads). A peer that finds no member with progress, or none that mixes with it,
        resumes from the coordinator's checkpoint, if the run has one."""
        if not self._joining:
            self._resume()
            return
        deadline = time.monotonic() + 2 * (self._record.gossip_wait + MEMBERS_EVERY_S)
        self._runner.catch_up(True)
        try:
            while self._runner.weight <= 2 * JOIN_WEIGHT and time.monotonic() < deadline:
                time.sleep(JOIN_POLL_S)
        finally:
            self._runner.catch_up(False)
        if self._runner.weight > 2 * JOIN_WEIGHT:
            log.info("took its neighbours' parameters at epoch %d", self.local_epoch)
            return
        log.warning(
            "no neighbour mixed with this peer within %.0f s of joining (they may have "
            "left): it starts from the run's checkpoint, if any",
            2 * (self._record.gossip_wait + MEMBERS_EVERY_S),
        )
        self._resume()

    def _resume(self) -> None:
        """Start from the run's checkpoint (every volunteer left; the coordinator serves
        it): its parameters, full weight and its epoch."""
        try:
            status = read_status(self._dht, self._record.run)
        except Exception as exc:  # no status: a run that has not checkpointed yet
            log.warning("could not read the run's status: %s", exc)
            return
        if status is None or status.checkpoint_peer is None or not status.checkpoint_epoch:
            return
        try:
            state = self._runner.fetch_state(
                status.checkpoint_peer, timeout_s=self._record.load_state_timeout
            )
        except FlotillaError as exc:  # train from the initial model: say so
            log.warning("could not download the run's checkpoint; starting afresh: %s", exc)
            return
        self._runner.restore(state)
        self.local_epoch = max(self.local_epoch, state.step)
        log.info("resumed from the run's checkpoint of epoch %d", state.step)

    def zero_grad(self) -> None:
        self._opt.zero_grad()

    def step(self) -> None:
        """A local step; after this peer's share of an epoch's samples, a gossip step."""
        with self._runner.lock:
            self._opt.step()
        self._samples += self._batch_size
        members = len(self.members())
        if self._samples >= math.ceil(self._record.target_batch_size / members):
            self._samples = 0
            self._gossip()

    def _gossip(self) -> None:
        # A share from a non-member is most often a peer that just joined: read the
        # members now rather than at the next read (at most once an epoch).
        strangers = self._runner.strangers
        self.members.refresh(force=strangers != self._strangers)
        self._strangers = strangers
        if self.members.epoch > self.local_epoch + 1:  # fell behind: sync pairs by epoch
            self.local_epoch = self.members.epoch
        if self._record.gossip_mode == "async":
            self._gossip_async()
            return
        started = self._runner.step(self.local_epoch)
        self.local_epoch += 1
        self._collect(started)

    def _gossip_async(self) -> None:
        """Delayed averaging that never waits for the link: a step starts only once the
        last one has ended (its shares answered or given up); until then epochs train on
        unmixed, so a slow link lowers how often a peer mixes, never how fast it trains."""
        last = self._pending
        if last is not None and not last.done():
            self.local_epoch += 1
            return
        if last is not None:
            self._collect(last)
        self._pending = self._runner.step(self.local_epoch)
        self.local_epoch += 1

    def _collect(self, future: Future[StepReport]) -> None:
        """Wait for a gossip step (it ends within the record's wait) and count it."""
        deadline = time.monotonic() + self._record.gossip_wait * 2
        while True:  # in slices: a stop signal's handler runs only when this thread wakes
            try:
                report = future.result(timeout=WAKE_EVERY_S)
                break
            except TimeoutError:
                if time.monotonic() >= deadline:
                    log.warning("a gossip step did not end within twice its wait")
                    return
            except Exception as exc:  # a step that failed mixed nothing: train on
                log.warning("a gossip step failed: %r", exc)
                return
        self._neighbours = sorted({*report.taken_by, *report.mixed_from})
        if report.taken_by or report.mixed_from:
            self.averaged_epochs += 1

    def cancel_rounds(self) -> None:
        """Nothing to cancel: a gossip step waits at most the record's ``gossip_wait``."""

    def leave(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Say goodbye (the others stop sending to this peer at their next read), stop."""
        if not self._closed.is_set():
            self._closed.set()
            self._background.shutdown(wait=False, cancel_futures=True)
            self._announce(leaving=True)
            self._runner.close(close_s=Timeouts().swarm_leave_s / 2)
