"""A volunteer: join a run from its signed record and train until told to stop.

The record names the task, the initial model's hash and the optimizer; the volunteer
refuses a run whose task it does not have installed or whose initial model differs from
its own build (another version of the task). It loads the current state from peers before
its first step (late joiners start on the current epoch), trains on the corpus shard its
peer id picks, and reports signed metrics (loss, samples/s, per-epoch loss) to the DHT.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flotilla.core.errors import RunRecordError
from flotilla.core.lifetime import Interrupted, StopEvent
from flotilla.core.spec import DataSection
from flotilla.core.timeouts import Timeouts
from flotilla.p2p.codecs import install_codecs
from flotilla.p2p.dht import PeerMetrics, fetch_record, publish_metrics, start_dht
from flotilla.p2p.record import RunRecord
from flotilla.p2p.swarm import make_optimizer, model_sha256
from flotilla.tasks.base import Shard, load_task

log = logging.getLogger(__name__)
#: Seconds between a volunteer's metric reports.
METRICS_EVERY_S = 2.0
#: Per-epoch losses a report carries (the coordinator merges them into the history).
EPOCHS_REPORTED = 16


@dataclass(frozen=True, slots=True)
class VolunteerOptions:
    run: str
    initial_peers: Sequence[str]
    task: str
    batch_size: int | None = None
    client_mode: bool = False
    #: Assist averaging without training (needs incoming connections).
    auxiliary: bool = False
    host_maddrs: Sequence[str] | None = None
    #: Trust only records signed by this coordinator key (base64, as the coordinator prints).
    coordinator_key: str | None = None
    #: Keeps this volunteer's peer identity (so its peer id, and with it its data shard,
    #: stay the same across restarts).
    state_dir: Path | None = None
    #: Stop after this many optimizer epochs of the run (None: until stopped).
    max_epochs: int | None = None
    #: Its waits: the DHT's start, the run record's appearance, the optimizer's shutdown.
    timeouts: Timeouts = field(default_factory=Timeouts)


@dataclass
class VolunteerReport:
    """What a volunteer did, returned when it stops."""

    peer: str
    record: RunRecord
    first_epoch: int
    last_epoch: int
    steps: int = 0
    samples: int = 0
    #: Epochs whose gradients this peer averaged with others (the rest used its own).
    averaged_epochs: int = 0
    #: Mean training loss of this peer's steps in each epoch it trained in.
    epoch_losses: dict[int, float] = field(default_factory=dict)
    #: Seconds from joining to this peer's first step in each epoch (a stall shows as a gap).
    epoch_started: dict[int, float] = field(default_factory=dict)


def check_task(record: RunRecord, entrypoint: str) -> Any:
    """The run's task, or RunRecordError when this volunteer was started for another one."""
    if record.task != entrypoint:
        raise RunRecordError(
            f"run {record.run!r} trains task {record.task!r}; this volunteer has {entrypoint!r}"
        )
    task = load_task(entrypoint)  # TaskLoadError when not installed here
    for needed in ("loss", "batches"):
        if not callable(getattr(task, needed, None)):
            raise RunRecordError(
                f"task {entrypoint!r} has no {needed}() and cannot train in a volunteer run"
            )
    return task


def shard_of(peer_id: str, shards: int) -> Shard:
    digest = hashlib.sha256(peer_id.encode()).digest()
    return Shard(int.from_bytes(digest[:8], "big") % shards, shards)


def _seed_of(peer_id: str) -> int:
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[8:12], "big")


def run_volunteer(
    options: VolunteerOptions,
    stop: StopEvent | None = None,
    on_ready: Callable[[str, RunRecord], None] | None = None,
    *,
    on_trained: Callable[[VolunteerReport], None] | None = None,
) -> VolunteerReport:
    """Join ``options.run`` and train until ``stop`` (or ``max_epochs``). ``on_trained``
    gets the final report before the peer leaves the swarm, which a hard stop may cut short:
    what the peer did is out even then."""
    stop = stop or StopEvent()
    install_codecs()
    identity = options.state_dir / "identity.key" if options.state_dir else None
    timeouts = options.timeouts
    dht = start_dht(
        options.initial_peers,
        options.host_maddrs,
        options.client_mode,
        identity,
        startup_s=timeouts.dht_start_s,
    )
    opt = None
    try:
        record = fetch_record(dht, options.run, options.coordinator_key, timeouts.record_wait_s)
        task = check_task(record, options.task)
        model = task.build_model(record.seed)
        if model_sha256(model) != record.model_sha256:
            raise RunRecordError(
                f"this volunteer's {record.task} builds another initial model than the run's "
                "(a different version of the task?); refusing to train"
            )
        peer = str(dht.peer_id)
        batch_size = options.batch_size or record.batch_size
        opt = make_optimizer(
            dht,
            record,
            model,
            batch_size=batch_size,
            auxiliary=options.auxiliary,
            shutdown_s=timeouts.swarm_shutdown_s,
        )
        stop.on_stop(opt.cancel_rounds)
        opt.load_state_from_peers()
        report = VolunteerReport(peer, record, opt.local_epoch, opt.local_epoch)
        if on_ready is not None:
            on_ready(peer, record)
        log.info("joined run %s at epoch %d as %s", record.run, opt.local_epoch, peer)
        if options.auxiliary:
            _assist(opt, options, stop, report, dht)
        else:
            data = task.load_shard(shard_of(peer, record.shards), DataSection(seed=record.seed))
            batches = task.batches(data, batch_size, seed=_seed_of(peer))
            _train(task, model, opt, batches, options, stop, report, dht, batch_size)
        report.last_epoch = opt.local_epoch
        report.averaged_epochs = opt.averaged_epochs
        if on_trained is not None:
            on_trained(report)
        return report
    finally:
        if opt is not None and stop.is_set():
            opt.leave()
        elif opt is not None:
            opt.shutdown()
        dht.shutdown()


def _train(
    task: Any,
    model: Any,
    opt: Any,
    batches: Any,
    options: VolunteerOptions,
    stop: StopEvent,
    report: VolunteerReport,
    dht: Any,
    batch_size: int,
) -> None:
    sums: dict[int, list[float]] = {}
    last_report = 0.0
    started, samples_at_start = time.monotonic(), 0
    joined = started
    while not stop.is_set():
        if (
            options.max_epochs is not None
            and opt.local_epoch >= report.first_epoch + options.max_epochs
        ):
            break
        epoch = opt.local_epoch
        report.epoch_started.setdefault(epoch, round(time.monotonic() - joined, 3))
        x, y = next(batches)
        with opt.computing():  # a gossip run mixes the parameters in place meanwhile
            loss = task.loss(model, x, y)
            loss.backward()
        if not _step(opt, stop):
            break
        opt.zero_grad()
        value = float(loss.detach())
        if math.isfinite(value):
            acc = sums.setdefault(epoch, [0.0, 0.0])
            acc[0] += value
            acc[1] += 1
        report.steps += 1
        report.samples += len(y)
        now = time.monotonic()
        if now - last_report >= METRICS_EVERY_S:
            rate = (report.samples - samples_at_start) / max(now - started, 1e-6)
            started, samples_at_start = now, report.samples
            report.epoch_losses = {e: s / n for e, (s, n) in sums.items() if n}
            _report(
                dht, options.run, report, opt.local_epoch, rate,
                sketch=opt.sketch(), neighbours=opt.neighbours(), wait=False,
            )  # fmt: skip
            last_report = now
    report.epoch_losses = {e: s / n for e, (s, n) in sums.items() if n}
    # No sketch on the way out: computing one delays a Ctrl-C, and a leaving gossip peer's
    # goodbye replaces these metrics at once.
    _report(dht, options.run, report, opt.local_epoch, 0.0)


def _assist(
    opt: Any, options: VolunteerOptions, stop: StopEvent, report: VolunteerReport, dht: Any
) -> None:
    """An auxiliary peer: join every averaging round with no samples of its own."""
    last_report = 0.0
    while not stop.is_set():
        if (
            options.max_epochs is not None
            and opt.local_epoch >= report.first_epoch + options.max_epochs
        ):
            break
        if not _step(opt, stop):
            break
        if time.monotonic() - last_report >= METRICS_EVERY_S:
            _report(dht, options.run, report, opt.local_epoch, 0.0, auxiliary=True)
            last_report = time.monotonic()
        stop.wait(0.2)


def _step(opt: Any, stop: StopEvent) -> bool:
    """One optimizer step, or False when a stop signal came first or cut it short: a step
    may wait a whole averaging round (up to the record's timeout), and Ctrl-C must not."""
    try:
        with stop.interruptible():
            opt.step()
    except Interrupted:
        return False
    return True


def _report(
    dht: Any,
    run: str,
    report: VolunteerReport,
    epoch: int,
    rate: float,
    auxiliary: bool = False,
    sketch: list[float] | None = None,
    neighbours: list[str] | None = None,
    wait: bool = True,
) -> None:
    """Publish this peer's metrics; ``wait=False`` from the training loop, which must not
    wait for the DHT."""
    recent = sorted(report.epoch_losses)[-EPOCHS_REPORTED:]
    current = report.epoch_losses.get(epoch) or (
        report.epoch_losses[recent[-1]] if recent else None
    )
    metrics = PeerMetrics(
        peer=report.peer,
        epoch=epoch,
        steps=report.steps,
        samples=report.samples,
        samples_per_second=rate,
        loss=current,
        epoch_losses={str(e): report.epoch_losses[e] for e in recent},
        auxiliary=auxiliary,
        time=time.time(),
        sketch=sketch,
        neighbours=neighbours,
    )
    try:
        publish_metrics(dht, run, metrics, wait=wait)
    except Exception as exc:  # a metrics write must never stop training
        log.warning("could not publish metrics: %s", exc)
