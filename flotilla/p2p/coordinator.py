"""A volunteer run's coordinator: bootstrap peer, record publisher, checkpointer, monitor.

It signs and publishes the run record (re-published before it expires), merges the peers'
signed metrics into a global loss per epoch, publishes the run's status for
``flotilla volunteer status``, and keeps the shared model on disk: every
``checkpoint_every`` epochs it downloads the newest state from a volunteer (a gossip run:
the weighted mean of its most advanced members' states) and writes it to
``STATE_DIR/checkpoint.safetensors``. It also shares that state, so when every
volunteer has left, the next ones resume from the last checkpoint rather than from scratch;
a restarted coordinator loads it back (and its record, so the run keeps its identity).
``coordinator.json`` (multiaddrs, key) and ``status.json`` in the state directory let a
hosting federation server list the run without importing hivemind.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flotilla.core.errors import FlotillaError
from flotilla.core.files import write_atomic
from flotilla.core.timeouts import Timeouts
from flotilla.p2p.codecs import install_codecs
from flotilla.p2p.dht import (
    ONLINE_S,
    PeerMetrics,
    RunStatus,
    publish_record,
    publish_status,
    read_metrics,
    start_dht,
    training_peers,
    visible_maddrs,
)
from flotilla.p2p.gossip.consensus import SKETCH_DIMS, consensus_distance
from flotilla.p2p.gossip.pushsum import GossipShare
from flotilla.p2p.gossip.state import StateService, mean_state
from flotilla.p2p.record import (
    RunRecord,
    SignedRecord,
    load_or_create_key,
    public_key_text,
    sign_record,
)
from flotilla.p2p.swarm import load_checkpoint, make_optimizer, model_sha256, save_checkpoint
from flotilla.tasks.base import load_task

log = logging.getLogger(__name__)
#: Seconds between republishing the record (its DHT entry lives RECORD_TTL_S).
REPUBLISH_S = 30.0
#: A gossip run's checkpoint is the weighted mean of this many members' states (the most
#: advanced): enough to average out one peer's drift, few enough to fetch in a tick.
CHECKPOINT_PEERS = 4


@dataclass(frozen=True, slots=True)
class CoordinatorOptions:
    run: str
    task: str
    state_dir: Path
    host_maddrs: Sequence[str] | None = None
    initial_peers: Sequence[str] = ()
    #: Save the shared model every this many epochs.
    checkpoint_every: int = 1
    #: RunRecord fields for a new run (a restarted coordinator keeps its saved record).
    record: dict[str, Any] = field(default_factory=dict)


class Coordinator:
    def __init__(self, options: CoordinatorOptions) -> None:
        self.options = options
        self._dir = options.state_dir
        self._history: dict[int, dict[str, float]] = {}
        self.checkpoint_epoch: int | None = None
        self._last_publish = 0.0
        self._dht: Any = None
        self._opt: Any = None
        #: A gossip run's: fetches members' states, serves the checkpoint.
        self._states: StateService | None = None
        self._model: Any = None
        self._signed: SignedRecord | None = None
        self.record: RunRecord | None = None
        #: Plain hivemind peers already reported (a verified run averages without them).
        self._plain_seen: set[str] = set()
        self.public_key = ""

    @property
    def checkpoint_path(self) -> Path:
        return self._dir / "checkpoint.safetensors"

    def start(self) -> list[str]:
        """Start the DHT and the run; the multiaddrs peers can join on."""
        install_codecs()
        self._dir.mkdir(parents=True, exist_ok=True)
        key = load_or_create_key(self._dir / "coordinator.key")
        self.public_key = public_key_text(key.public_key())
        task = load_task(self.options.task)
        record = self._load_or_make_record(task)
        model = task.build_model(record.seed)
        self.checkpoint_epoch = load_checkpoint(self.checkpoint_path, model, record)
        self._load_history()
        # A stable peer id: volunteers' --initial-peers stay valid across coordinator restarts.
        self._dht = start_dht(
            self.options.initial_peers,
            self.options.host_maddrs,
            identity_path=self._dir / "p2p-identity.key",
        )
        self._model = model  # the optimizer's main parameters: what peers share
        if record.averaging == "gossip":  # no group state: members serve their own
            shapes = [p.shape for p in self._params()]
            self._states = StateService(self._dht, record.swarm, shapes)
            self._states.start(start_s=Timeouts().dht_start_s)
            if self.checkpoint_epoch is not None:
                self._offer(self.checkpoint_epoch)
        else:
            self._opt = make_optimizer(self._dht, record, model, batch_size=1)
            if self.checkpoint_epoch is not None:
                self._share_epoch(self.checkpoint_epoch)
        self.record, self._signed = record, sign_record(record, key)
        publish_record(self._dht, record.run, self._signed)
        self._last_publish = time.monotonic()
        maddrs = visible_maddrs(self._dht)
        _write_json(
            self._dir / "coordinator.json", {"maddrs": maddrs, "public_key": self.public_key}
        )
        return maddrs

    def _load_or_make_record(self, task: Any) -> RunRecord:
        path = self._dir / "record.json"
        if path.exists():
            saved = RunRecord.from_dict(json.loads(path.read_text()))
            if saved.run != self.options.run or saved.task != self.options.task:
                raise ValueError(
                    f"{self._dir} holds run {saved.run!r} of {saved.task!r}, not "
                    f"{self.options.run!r} of {self.options.task!r}"
                )
            return saved
        seed = int(self.options.record.get("seed", 0))
        record = RunRecord(
            run=self.options.run,
            task=self.options.task,
            model_sha256=model_sha256(task.build_model(seed)),
            **self.options.record,
        )
        _write_json(path, dataclasses.asdict(record))
        return record

    def _load_history(self) -> None:
        path = self._dir / "history.json"
        if path.exists():
            raw = json.loads(path.read_text())
            self._history = {int(e): dict(peers) for e, peers in raw.items()}

    def _save_history(self) -> None:
        _write_json(
            self._dir / "history.json", {str(e): p for e, p in sorted(self._history.items())}
        )

    def _share_epoch(self, epoch: int) -> None:
        """Offer our state at ``epoch`` to peers that load state (late or resuming ones)."""
        averager = self._opt.state_averager
        averager.local_epoch = max(averager.local_epoch, epoch)
        averager.state_sharing_priority = averager.local_epoch
        self._opt.tracker.report_local_progress(averager.local_epoch, 0)

    def tick(self) -> RunStatus:
        """One round of duties; call it every second or so."""
        assert self.record is not None and self._signed is not None
        now = time.monotonic()
        if now - self._last_publish >= REPUBLISH_S:
            publish_record(self._dht, self.record.run, self._signed)
            self._last_publish = now
        metrics = read_metrics(self._dht, self.record.run)
        self._merge(metrics)
        if self.record.verified_averaging:
            self._note_plain_peers()
        progress = self._opt.tracker.global_progress if self._opt is not None else None
        epoch = max([progress.epoch if progress else 0, *(m.epoch for m in metrics)], default=0)
        if self._due_for_checkpoint(epoch):
            if self._opt is not None:
                self._checkpoint()
            elif self._states is not None:
                self._checkpoint_gossip(metrics)
        status = self._status(metrics, epoch, progress)
        publish_status(self._dht, status)
        _write_json(self._dir / "status.json", dataclasses.asdict(status))
        return status

    def _note_plain_peers(self) -> None:
        """Say once per peer that a plain hivemind peer (training under the run's own name,
        not the verified swarm's) will average with nobody here, and what would let it."""
        assert self.record is not None
        for peer in sorted(training_peers(self._dht, self.record.run) - self._plain_seen):
            self._plain_seen.add(peer)
            log.warning(
                "peer %s trains run %s with plain hivemind averaging: this run averages only "
                "between flotilla peers (verified, whole-or-nothing rounds), so that peer "
                "trains alone; a coordinator started with --plain-averaging lets plain "
                "hivemind peers average",
                peer,
                self.record.run,
            )

    def _merge(self, metrics: list[PeerMetrics]) -> None:
        changed = False
        for m in metrics:
            for e, loss in m.epoch_losses.items():
                epoch = int(e)
                if self._history.setdefault(epoch, {}).get(m.peer) != loss:
                    self._history[epoch][m.peer] = loss
                    changed = True
        if changed:
            self._save_history()

    def _due_for_checkpoint(self, epoch: int) -> bool:
        every = max(1, self.options.checkpoint_every)
        last = self.checkpoint_epoch if self.checkpoint_epoch is not None else 0
        return epoch >= last + every

    def _checkpoint(self) -> None:
        assert self.record is not None
        averager = self._opt.state_averager
        before = averager.local_epoch
        try:
            averager.load_state_from_peers(timeout=self.record.load_state_timeout)
        except Exception as exc:  # no peer answered in time: try again next tick
            log.warning("could not download the run's state: %s", exc)
            return
        if averager.local_epoch <= before and self.checkpoint_epoch is not None:
            return
        save_checkpoint(self.checkpoint_path, self._model, averager.local_epoch, self.record)
        self.checkpoint_epoch = averager.local_epoch
        self._share_epoch(averager.local_epoch)
        log.info("checkpoint of epoch %d saved", averager.local_epoch)

    def _params(self) -> list[Any]:
        """The tensors a gossip run mixes, in the order its peers send them."""
        return [p for p in self._model.parameters() if p.requires_grad]

    def _checkpoint_gossip(self, metrics: list[PeerMetrics]) -> None:
        """Save the weighted mean of the most advanced members' states (push-sum's network
        average, as far as those members hold it) and serve it."""
        assert self.record is not None and self._states is not None
        now = time.time()
        members = sorted(
            (m for m in metrics if now - m.time <= ONLINE_S and not m.auxiliary),
            key=lambda m: -m.epoch,
        )[:CHECKPOINT_PEERS]
        states: list[GossipShare] = []
        fetched = self._states.fetch_all([m.peer for m in members], self.record.load_state_timeout)
        for m, state in zip(members, fetched, strict=True):
            if isinstance(state, GossipShare):
                states.append(state)
            elif isinstance(state, FlotillaError):  # left, or not serving yet: others will do
                log.info("no state from %s for the checkpoint: %s", m.peer, state)
            else:  # a bug, not a peer's doing: say so, and checkpoint from the others
                log.warning("fetching %s's state failed: %r", m.peer, state)
        if not states:
            return
        mean = mean_state(states)
        if self.checkpoint_epoch is not None and mean.step <= self.checkpoint_epoch:
            return
        with torch.no_grad():
            for param, value in zip(self._params(), mean.tensors, strict=True):
                param.copy_(value)
        save_checkpoint(self.checkpoint_path, self._model, mean.step, self.record)
        self._offer(mean.step)
        log.info("checkpoint of epoch %d saved (mean of %d peers)", mean.step, len(states))

    def _offer(self, epoch: int) -> None:
        """Serve the model as the run's checkpoint of ``epoch`` to peers that resume it."""
        assert self._states is not None
        self.checkpoint_epoch = epoch
        params = tuple(p.detach().clone() for p in self._params())
        self._states.offer(GossipShare(epoch, 1.0, params))

    def _status(self, metrics: list[PeerMetrics], epoch: int, progress: Any) -> RunStatus:
        assert self.record is not None
        fresh = [m for m in metrics if time.time() - m.time <= ONLINE_S and not m.auxiliary]
        means = {e: sum(peers.values()) / len(peers) for e, peers in self._history.items() if peers}
        current = means.get(epoch)
        if current is None and means:
            current = means[max(means)]
        return RunStatus(
            run=self.record.run,
            epoch=epoch,
            peers_online=max(len(fresh), int(progress.num_peers) if progress else 0),
            samples_per_second=float(sum(m.samples_per_second for m in fresh)),
            loss=current,
            loss_history=[[e, means[e]] for e in sorted(means) if e < epoch],
            checkpoint_epoch=self.checkpoint_epoch,
            time=time.time(),
            averaging=self.record.averaging,
            consensus_distance=_consensus(fresh),
            checkpoint_peer=str(self._dht.peer_id)
            if self._states is not None and self.checkpoint_epoch is not None
            else None,
            neighbours={m.peer: m.neighbours for m in fresh if m.neighbours is not None}
            if self._states is not None
            else None,
        )

    def serve(
        self, stop: threading.Event, on_status: Callable[[RunStatus], None] | None = None
    ) -> None:
        while not stop.is_set():
            status = self.tick()
            if on_status is not None:
                on_status(status)
            stop.wait(1.0)

    def shutdown(self) -> None:
        if self._opt is not None:
            self._opt.shutdown()
        if self._states is not None:
            self._states.close(close_s=Timeouts().swarm_leave_s)
        if self._dht is not None:
            self._dht.shutdown()


def _consensus(metrics: list[PeerMetrics]) -> float | None:
    """The consensus distance of the peers whose metrics carry a sketch of the usual size
    (None below two: nothing to compare)."""
    sketches = [m.sketch for m in metrics if m.sketch is not None and len(m.sketch) == SKETCH_DIMS]
    return consensus_distance(sketches) if len(sketches) >= 2 else None


def _write_json(path: Path, data: Any) -> None:
    """Atomically: readers (the hosting server) never see half a file."""
    write_atomic(path, json.dumps(data).encode())
