"""One hivemind.Optimizer per peer, configured from the run record; and model checkpoints.

Unless the record turns ``verified_averaging`` off (runs open to plain-hivemind peers), its
gradient and state averagers are flotilla's whole-or-nothing ones
(:mod:`flotilla.p2p.averaging`): a round a peer died in is reverted, never half applied.

Every averaging phase gets the record's explicit timeouts (hivemind's raw averager waits
without bound by default), and the record's compression for gradients and state; states
downloaded by late joiners travel uncompressed, so they start exactly where the swarm is.
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path
from typing import Any

import hivemind
import torch

from flotilla.core.blobs import sha256_hex
from flotilla.core.errors import SpecError
from flotilla.core.files import write_atomic
from flotilla.core.tensors import decode_state, encode_state, read_metadata
from flotilla.core.timeouts import Timeouts
from flotilla.p2p.averaging import (
    PlainGradientAverager,
    PlainStateAverager,
    SafeGradientAverager,
    SafeStateAverager,
)
from flotilla.p2p.codecs import hivemind_compression
from flotilla.p2p.gossip_optimizer import GossipOptimizer, local_optimizer
from flotilla.p2p.noise import quiet_hivemind
from flotilla.p2p.record import RunRecord
from flotilla.p2p.tracker import TidyProgressTracker
from flotilla.tasks.base import load_model_state, model_state

#: hivemind's default is a 10 s wait before the first progress fetch; volunteer runs on
#: slow links still want epochs noticed within a second or two.
TRACKER_OPTS = {"min_refresh_period": 0.5, "max_refresh_period": 3.0, "default_refresh_period": 1.0}


def model_sha256(model: torch.nn.Module) -> str:
    """Hash of a model's weights in the wire format, equal wherever the weights are."""
    return sha256_hex(encode_state(model_state(model)))


class CountingOptimizer(hivemind.Optimizer):  # type: ignore[misc]
    """hivemind.Optimizer that counts the epochs whose gradients were averaged with peers
    (hivemind falls back to local gradients silently when averaging fails). Its averagers
    are hivemind's own, leaving the caller's Ctrl-C alone (:class:`HivemindWire`)."""

    averaged_epochs = 0
    #: The state averager's class: hivemind's own, or whole-or-nothing.
    state_averager_type: type[Any] = PlainStateAverager

    def computing(self) -> contextlib.nullcontext[None]:
        """What a forward and backward pass hold: nothing here (group rounds change the
        parameters inside ``step``); a gossip run's optimizer holds its mixing off."""
        return contextlib.nullcontext()

    def sketch(self) -> list[float] | None:
        """Group runs publish no sketch: their peers agree after every round."""
        return None

    def neighbours(self) -> list[str] | None:
        """Group runs have no neighbours: a round's group is whoever matched."""
        return None

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control: Any) -> None:
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        if maybe_step_control is not None and maybe_step_control.done():
            with contextlib.suppress(Exception):
                if maybe_step_control.exception(timeout=0) is None:
                    self.averaged_epochs += 1

    def cancel_rounds(self) -> None:
        """Cancel the averaging rounds in flight: every wait on them ends at once (a step
        falls back to its local gradients), where it would wait out the round's timeout.
        Their groups revert or retry without this peer, as when a peer dies."""
        for scheduled in (self.scheduled_grads, self.scheduled_state):
            if scheduled is not None and not scheduled.done():
                scheduled.cancel()

    def leave(self) -> None:
        """Shut down at once (Ctrl-C). hivemind's ``shutdown`` first takes part in the
        rounds in flight with zero weight and waits for a background state round, each up
        to its timeout; here the rounds are cancelled and the averagers stopped."""
        self.cancel_rounds()
        self.tracker.shutdown(self.shutdown_timeout)
        self.state_averager.shutdown()
        if self.use_gradient_averaging:
            self.grad_averager.shutdown()

    def _make_progress_tracker(self, target_batch_size: int, **kwargs: Any) -> Any:
        return TidyProgressTracker(
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            **kwargs,
        )

    def _make_state_averager(self, **kwargs: Any) -> Any:
        return self.state_averager_type(
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )


class VerifiedOptimizer(CountingOptimizer):
    """hivemind.Optimizer whose gradient and state rounds commit whole or are reverted."""

    state_averager_type = SafeStateAverager


def make_optimizer(
    dht: hivemind.DHT,
    record: RunRecord,
    model: torch.nn.Module,
    *,
    batch_size: int | None,
    auxiliary: bool = False,
    shutdown_s: float | None = None,
) -> CountingOptimizer | GossipOptimizer:
    """The run's optimizer: hivemind's, or a gossip run's; ``shutdown_s`` defaults to
    ``Timeouts.swarm_shutdown_s``."""
    quiet_hivemind()  # before hivemind forks the averagers, which inherit it
    if record.averaging == "gossip":
        if auxiliary:
            raise SpecError(
                "a gossip run has no averaging rounds to assist: --auxiliary is for runs "
                "that average in groups"
            )
        return GossipOptimizer(dht, record, model, batch_size=batch_size or record.batch_size)
    compression = hivemind_compression(record.compression)
    factory = local_optimizer(record)
    gradients = record.averaging == "gradients"
    verified = record.verified_averaging
    # hivemind warns (and may deadlock) when a request may outlive matchmaking; its
    # Optimizer hands averager_opts to the state averager only, so the gradient averager
    # gets the same bound here.
    averager_opts = {"request_timeout": min(3.0, record.matchmaking_time / 2)}
    grad_averager = SafeGradientAverager if verified else PlainGradientAverager
    optimizer_class = VerifiedOptimizer if verified else CountingOptimizer
    return optimizer_class(
        dht=dht,
        run_id=record.swarm,
        target_batch_size=record.target_batch_size,
        batch_size_per_step=None if auxiliary else batch_size,
        optimizer=factory,
        params=model.parameters(),
        matchmaking_time=record.matchmaking_time,
        averaging_timeout=record.averaging_timeout,
        allreduce_timeout=record.allreduce_timeout,
        next_chunk_timeout=record.next_chunk_timeout,
        load_state_timeout=record.load_state_timeout,
        use_local_updates=not gradients,
        client_mode=dht.client_mode,
        auxiliary=auxiliary,
        grad_compression=compression,
        grad_averager_factory=functools.partial(grad_averager, **averager_opts)
        if gradients
        else None,
        state_averaging_compression=compression,
        # Bagua's communication delay: the round runs beside the next epoch's compute.
        delay_grad_averaging=record.delayed_averaging,
        delay_optimizer_step=record.delayed_averaging,
        tracker_opts=dict(TRACKER_OPTS),
        averager_opts=averager_opts,
        verbose=False,
        shutdown_timeout=Timeouts().swarm_shutdown_s if shutdown_s is None else shutdown_s,
    )


def save_checkpoint(path: Path, model: torch.nn.Module, epoch: int, record: RunRecord) -> None:
    """Weights and epoch as safetensors, written atomically (never pickle)."""
    meta = {"epoch": str(epoch), "run": record.run, "task": record.task}
    write_atomic(path, encode_state(model_state(model), meta))


def load_checkpoint(path: Path, model: torch.nn.Module, record: RunRecord) -> int | None:
    """Load ``path`` into ``model``; its epoch, or None when there is no checkpoint."""
    if not path.exists():
        return None
    data = path.read_bytes()
    meta = read_metadata(data, len(data))
    state = decode_state(data)
    if meta.get("run") != record.run or meta.get("task") != record.task:
        raise ValueError(f"{path} is a checkpoint of another run or task: {json.dumps(meta)}")
    load_model_state(model, state)
    return int(meta["epoch"])
