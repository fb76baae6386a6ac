"""All-reduce that never leaves a partial average behind.

When a peer dies mid all-reduce, hivemind 1.1.12 lets the survivors finish anyway: a part
whose reducer died keeps the local values (``Averaging: received 70% results``, a warning),
and a reducer that bans a dead sender averages the rest of its span without it, so one
tensor can mix several contributor sets. :class:`SafeAverager` runs each round as:

1. hivemind's butterfly all-reduce, its outputs held back rather than applied;
2. a local verdict: clean when no part came back missing and this peer's reducer banned
   no sender;
3. a second, tiny all-reduce in the same group of one slot per sender, each writing 1 in
   its own slot when its verdict is clean; a dead peer leaves its slot 0, a dead verdict
   reducer fails the round for everyone;
4. apply the outputs only when every slot is non-zero; otherwise drop them and raise, so
   hivemind retries with whoever is left until the step's deadline.

A step that times out leaves the local tensors untouched too. hivemind cannot cancel an
all-reduce once it runs, so the averaging process may reach step 4 after the caller gave
up; a commit gate (a lock shared by both processes) decides exactly one of "the caller
gave up" and "the round was applied", whichever comes first. A caller of
:meth:`SafeAverager.step` never waits past its timeout unless the round was applied in
that same instant (then it waits for the outcome, milliseconds). A committed step returns
a :class:`AllReduceOutcome`: who contributed, and the attempts reverted before it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import logging
import multiprocessing
import signal
import time
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import BannedException
from hivemind.compression import NoCompression, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.asyncio import amap_in_executor

from flotilla.core.errors import FlotillaError
from flotilla.core.lifetime import die_with_parent
from flotilla.core.timeouts import Timeouts

VERDICT_SUFFIX = b".flotilla-verdict"
log = logging.getLogger(__name__)


class IncompleteAllReduce(AllreduceException):  # type: ignore[misc]
    """A round could not be completed by every member; local tensors were restored."""


@dataclass(frozen=True)
class AllReduceOutcome:
    """What a committed step did: who contributed, and the rounds reverted before it."""

    #: Peer id (base58) -> what that peer passed as ``gather``; every one contributed.
    gathered: dict[str, Any]
    contributors: tuple[str, ...]
    group_id: str
    #: ``(group id, reason)`` of each earlier attempt of this step that was reverted.
    reverted: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    #: Seconds the committed attempt's all-reduce took, verdict included.
    seconds: float = 0.0


class HivemindWire:
    """Mixin for every hivemind averager flotilla runs: it speaks hivemind's own protocol,
    and leaves the caller's Ctrl-C alone. List it before the averager class in the bases.

    hivemind names each RPC handler after the servicer's class
    (``{prefix}::GradientAverager.rpc_join_group``); a subclass would answer under its own
    name, and plain hivemind peers could not reach it, nor it them. Handlers here keep the
    name of the hivemind class underneath."""

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        wire: Any = next(c for c in cls.__mro__ if c.__module__.startswith("hivemind."))
        handle: str = wire._get_handle_name(namespace, method_name)
        return handle

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """hivemind ignores SIGINT in the *calling* process, for good, so that the child
        inherits it; that also works only from the main thread. Start from any thread and
        leave the caller's Ctrl-C alone; the child ignores SIGINT itself (``run``).

        hivemind waits for the forked child without a deadline; a child that never gets
        ready (one forked while another thread held a lock it needs) would hang the caller
        for good. Wait ``timeout`` (default ``Timeouts.averager_start_s``), then kill it."""
        self.start()  # type: ignore[attr-defined]
        if not await_ready:
            return
        limit_s = Timeouts().averager_start_s if timeout is None else timeout
        try:
            self.wait_until_ready(limit_s)  # type: ignore[attr-defined]
        except (TimeoutError, concurrent.futures.TimeoutError) as exc:
            self.kill()  # type: ignore[attr-defined]
            self.join(Timeouts().child_stop_s)  # type: ignore[attr-defined]
            raise FlotillaError(f"the averager process was not ready in {limit_s:.0f} s") from exc

    def run(self) -> None:
        die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
        super().run()  # type: ignore[misc]

    async def _shutdown(self, timeout: float | None) -> None:
        """hivemind 1.1.12 fails to shut down while a round runs: it calls ``finalize`` on
        the future it keeps per running group rather than on the runner inside
        (AttributeError in the averager's thread, and a caller that waits out its shutdown
        timeout). Here each running round is cancelled through its runner."""
        del timeout  # nothing is left to wait for: cancelling a runner is immediate
        # This process ends with its loop: what the rounds torn down here leave behind (the
        # matchmaking pending, a stream's future reset by the peer) would each be logged as
        # an error as it is destroyed.
        logging.disable(logging.CRITICAL)
        this: Any = self
        if not this.client_mode:
            await this.remove_p2p_handlers(this._p2p, namespace=this.prefix)
        for slot in list(this._running_groups.values()):
            if not slot.done():
                slot.cancel()
            elif not slot.cancelled() and slot.exception() is None:
                slot.result().finalize(cancel=True)

    async def _step(self, *, step: StepControl, future_for_init: Any) -> None:
        """hivemind sets a finished round's result even when its caller cancelled the
        step meanwhile (the optimizer does, falling out of sync); the ``InvalidStateError``
        that raises would end the task unretrieved, an ERROR with a traceback in a healthy
        run. A cancelled step has no one left to tell."""
        try:
            await super()._step(step=step, future_for_init=future_for_init)  # type: ignore[misc]
        except concurrent.futures.InvalidStateError:
            if not step.cancelled():
                raise
            log.debug("an averaging round finished after its step was cancelled")


class CompleteRounds(HivemindWire):
    """Mixin for a hivemind averager: each all-reduce round commits whole or is reverted
    (see the module doc). List it before the averager class in the bases."""

    _running_groups: dict[bytes, Any]
    _p2p: Any
    prefix: str
    peer_id: Any
    _averaging_alpha: float
    _state_updated: Any
    last_updated: float
    #: The main round's runner; AgreedAverager swaps in one whose members end identical.
    runner_type: type[AllReduceRunner] = AllReduceRunner

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Set before the parent starts (forks) the averaging process, which uses it.
        self._reverted: list[tuple[str, str]] = []
        super().__init__(*args, **kwargs)

    def _pop_reverted(self) -> tuple[tuple[str, str], ...]:
        reverted, self._reverted = tuple(self._reverted), []
        return reverted

    @contextlib.contextmanager
    def _register_allreduce_group(self, group_info: GroupInfo) -> Iterator[None]:
        verdict = group_info.group_id + VERDICT_SUFFIX
        self._running_groups[verdict] = asyncio.Future()
        try:
            with super()._register_allreduce_group(group_info):  # type: ignore[misc]
                yield
        finally:
            self._running_groups.pop(verdict, None)

    async def _run_allreduce_inplace_(
        self,
        tensors: Sequence[torch.Tensor],
        group_info: GroupInfo,
        group_id: bytes | None = None,
        **kwargs: Any,
    ) -> None:
        if group_id is not None:  # a verdict round or a subclass's extra phase
            await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)  # type: ignore[misc]
            return
        senders = _sender_ids(group_info)
        try:
            outputs, clean = await self._main_round(tensors, group_info, **kwargs)
            slots = await self._verdict_round(group_info, senders, clean, **kwargs)
        except BaseException as exc:
            self._reverted.append((group_info.group_id.hex(), f"{type(exc).__name__}: {exc}"))
            if isinstance(exc, Exception) and not isinstance(exc, AllreduceException):
                raise IncompleteAllReduce(f"all-reduce failed and was reverted: {exc}") from exc
            raise
        if not bool((slots > 0).all()):
            missing = [str(p) for p, v in zip(senders, slots.tolist(), strict=True) if v <= 0]
            reason = f"incomplete: peers {missing} did not finish cleanly"
            self._reverted.append((group_info.group_id.hex(), reason))
            log.warning("all-reduce %s reverted: %s", group_info.group_id.hex(), reason)
            raise IncompleteAllReduce(f"all-reduce {reason}; local tensors left as they were")
        self._apply(tensors, outputs)

    def _runner(
        self,
        group_info: GroupInfo,
        group_id: bytes,
        tensors: Sequence[torch.Tensor],
        runner_type: type[AllReduceRunner] = AllReduceRunner,
        **kwargs: Any,
    ) -> AllReduceRunner:
        """A runner for one all-reduce of this group, registered so peers' parts reach it."""
        runner = runner_type(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        return runner

    async def _main_round(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, **kwargs: Any
    ) -> tuple[list[torch.Tensor], bool]:
        """hivemind's all-reduce, its outputs held back (not applied) until the verdict;
        and whether it was clean here."""
        runner = self._runner(group_info, group_info.group_id, tensors, self.runner_type, **kwargs)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("auxiliary peers receive no averaged tensors")
            return [], not runner.banned_senders
        outputs = [output async for output in runner]
        missing = runner.tensor_part_container.failed_size
        return outputs, missing == 0 and not runner.banned_senders and len(outputs) == len(tensors)

    def _apply(self, tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        """Commit a round: the group's averages (agreed runners) or our deltas to them."""
        if not outputs:
            return  # an auxiliary peer holds no averaged tensors
        agreed = issubclass(self.runner_type, AgreedAllReduceRunner)
        with torch.no_grad():
            for tensor, output in zip(tensors, outputs, strict=True):
                if agreed:
                    tensor.copy_(output.reshape(tensor.shape))
                else:
                    tensor.add_(output.reshape(tensor.shape), alpha=self._averaging_alpha)
        self.last_updated = time.time()
        self._state_updated.set()

    async def _verdict_round(
        self, group_info: GroupInfo, senders: list[Any], clean: bool, **kwargs: Any
    ) -> torch.Tensor:
        slots = torch.zeros(len(senders))
        if self.peer_id in senders and clean:
            slots[senders.index(self.peer_id)] = 1.0
        verdict_kwargs = dict(kwargs)
        verdict_kwargs.update(weight=1.0, compression=NoCompression(), tensor_infos=None)
        verdict_id = group_info.group_id + VERDICT_SUFFIX
        runner = self._runner(group_info, verdict_id, [slots], **verdict_kwargs)
        async for delta in runner:
            slots.add_(delta)
        if runner.tensor_part_container.failed_size or runner.banned_senders:
            slots.zero_()  # the verdict itself is incomplete: nobody may commit on it
        return slots


class SafeAverager(CompleteRounds, DecentralizedAverager):  # type: ignore[misc]
    """A ``DecentralizedAverager`` with whole-or-nothing rounds; ``step`` returns a
    :class:`AllReduceOutcome` and never keeps a waiting caller past its timeout."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Shared with the averaging process, so made before the parent starts (forks) it.
        self._commit_gate = multiprocessing.Lock()
        self._open_step = multiprocessing.Array("c", _STEP_KEY_BYTES, lock=False)
        self._committed_step = multiprocessing.Array("c", _STEP_KEY_BYTES, lock=False)
        self._this_step: contextvars.ContextVar[bytes] = contextvars.ContextVar("step")
        super().__init__(*args, **kwargs)

    def step(
        self,
        *args: Any,
        timeout: float | None = None,
        wait: bool = True,
        require_trigger: bool = False,
        **kwargs: Any,
    ) -> Any:
        """hivemind's step, but a waiting caller never waits past ``timeout``: hivemind
        checks its deadline only between attempts, so one late attempt can overrun it.
        On expiry the step is cancelled, the tensors stay as they were, and TimeoutError
        is raised; or, when the round was applied first, its outcome is returned."""
        control = super().step(*args, timeout=timeout, wait=False, require_trigger=True, **kwargs)
        # Opened before the trigger: the all-reduce, so its commit, cannot start earlier.
        with self._commit_gate:
            self._open_step.raw = _step_key(control)
        if not require_trigger:
            control.allow_allreduce()
        if not wait:
            return control
        try:
            return control.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            with self._commit_gate:
                applied = self._committed_step.raw == _step_key(control)
                if not applied:
                    self._open_step.raw = bytes(_STEP_KEY_BYTES)
            if applied:  # the outcome is a message away
                return control.result(timeout=Timeouts().child_stop_s)
            control.cancel()
            raise TimeoutError(f"all-reduce did not complete within {timeout} s") from None

    async def _step(self, *, step: StepControl, **kwargs: Any) -> None:
        """Runs in the averaging process: remember which step this task serves."""
        self._this_step.set(_step_key(step))
        await super()._step(step=step, **kwargs)

    def _apply(self, tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        """Apply only a step its caller still waits for (see the module doc)."""
        key = self._this_step.get(b"")
        with self._commit_gate:
            if not key or self._open_step.raw != key:
                raise IncompleteAllReduce("the caller gave up on this step; tensors left as is")
            self._committed_step.raw = key
            super()._apply(tensors, outputs)

    async def _aggregate_with_group(
        self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any
    ) -> AllReduceOutcome:
        began = time.perf_counter()
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        seconds = time.perf_counter() - began
        return AllReduceOutcome(
            gathered={str(peer): data for peer, data in gathered.items()},
            contributors=tuple(str(p) for p in _sender_ids(group_info)),
            group_id=group_info.group_id.hex(),
            reverted=self._pop_reverted(),
            seconds=seconds,
        )


class AgreedAllReduceRunner(AllReduceRunner):  # type: ignore[misc]
    """Butterfly all-reduce after which every member holds the same bits.

    hivemind sends each sender ``average - its own part`` (compressed), so members end with
    averages that differ in their last bits, or by a whole quantization step with a lossy
    codec. Here each reducer encodes its averaged part once and sends those bytes to every
    sender, itself included; outputs are the decoded averages, identical everywhere, so a
    model built from them hashes the same on every member (what server-less federated
    rounds agree on).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._encoded: dict[int, asyncio.Future[runtime_pb2.Tensor]] = {}

    def _encoded_average(
        self, part_index: int, averaged: torch.Tensor, wire_type: Any
    ) -> asyncio.Future[runtime_pb2.Tensor]:
        future = self._encoded.get(part_index)
        if future is None:
            loop = asyncio.get_running_loop()
            future = loop.run_in_executor(None, serialize_torch_tensor, averaged, wire_type)
            self._encoded[part_index] = future
        return future

    async def _communicate_with_peer(self, peer_id: Any) -> None:
        if peer_id != self.peer_id:
            await super()._communicate_with_peer(peer_id)  # remote parts arrive encoded
            return
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        wire_type = self.tensor_part_container.compression.compression_type
        for part_index, part in enumerate(self.parts_for_local_averaging):
            averaged = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, part, weight=self.weight
            )
            encoded = await asyncio.shield(self._encoded_average(part_index, averaged, wire_type))
            decoded = deserialize_torch_tensor(encoded)
            self.tensor_part_container.register_processed_part(peer_index, part_index, decoded)

    async def _accumulate_parts_streaming(self, stream: Any, sender_index: int) -> Any:
        part_index = 0
        try:
            async for part, weight, wire_type in amap_in_executor(
                lambda msg: (
                    deserialize_torch_tensor(msg.tensor_part),
                    msg.weight,
                    msg.tensor_part.compression,
                ),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, part, weight=weight
                    )
                except BannedException:
                    break  # this sender was banned meanwhile; nothing more to send it
                encoded = self._encoded_average(part_index, averaged, wire_type)
                part_index += 1
                yield averaging_pb2.AveragingData(
                    code=averaging_pb2.AVERAGED_PART, tensor_part=await asyncio.shield(encoded)
                )
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


class StrangerInGroup(AllreduceException):  # type: ignore[misc]
    """A group held a peer the server did not name, or one posing as another device."""


class AgreedAverager(SafeAverager):
    """A :class:`SafeAverager` whose committed rounds leave every member with identical
    tensors (see :class:`AgreedAllReduceRunner`).

    With ``members`` (peer id -> device id, from the server), only those peers take part:
    a leader refuses anyone else's join request, and every member checks the assembled
    group (libp2p authenticates peer ids) and what each peer gathered as its device id
    before any tensor moves; a group with a stranger is abandoned and matchmaking retried.
    """

    runner_type = AgreedAllReduceRunner

    def __init__(self, *args: Any, members: Mapping[str, str] | None = None, **kwargs: Any):
        # Set before the parent starts (forks) the averaging process, which checks it.
        self._members = dict(members or {})
        super().__init__(*args, **kwargs)

    async def rpc_join_group(  # hivemind reads typing.AsyncIterator, not the abc's, as a stream
        self, request: averaging_pb2.JoinRequest, context: Any
    ) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:
        if self._members and context.remote_id.to_base58() not in self._members:
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for reply in super().rpc_join_group(request, context):
            yield reply

    async def _aggregate_with_group(
        self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any
    ) -> AllReduceOutcome:
        if self._members:
            check_members(group_info, self._members)
        return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)


def check_members(group_info: GroupInfo, members: Mapping[str, str]) -> None:
    """Raise StrangerInGroup unless every peer is named and gathered its own device id."""
    for peer, raw in zip(group_info.peer_ids, group_info.gathered, strict=True):
        device = members.get(peer.to_base58())
        if device is None:
            raise StrangerInGroup(f"peer {peer} is not one the server selected")
        try:
            claimed = MSGPackSerializer.loads(MSGPackSerializer.loads(raw)[2])
        except Exception as exc:
            raise StrangerInGroup(f"peer {peer} gathered malformed data: {exc}") from exc
        if not isinstance(claimed, dict) or claimed.get("device_id") != device:
            raise StrangerInGroup(f"peer {peer} of device {device} claims to be another device")


class PlainGradientAverager(HivemindWire, GradientAverager):  # type: ignore[misc]
    """hivemind.Optimizer's gradient averager as hivemind runs it (runs open to plain
    hivemind peers), but leaving the caller's Ctrl-C alone."""


class PlainStateAverager(HivemindWire, TrainingStateAverager):  # type: ignore[misc]
    """hivemind.Optimizer's state averager as hivemind runs it, leaving Ctrl-C alone."""


class SafeGradientAverager(CompleteRounds, GradientAverager):  # type: ignore[misc]
    """hivemind.Optimizer's gradient averager with whole-or-nothing rounds: after a
    reverted round the optimizer steps with this peer's own gradients, as hivemind does
    whenever gradient averaging fails."""


class SafeStateAverager(CompleteRounds, TrainingStateAverager):  # type: ignore[misc]
    """hivemind.Optimizer's parameter and statistics averager, whole-or-nothing."""


_STEP_KEY_BYTES = 16


def _step_key(step: StepControl) -> bytes:
    """A step's identity in both processes: its future's id (a UUID), as 16 bytes."""
    return int(step._uid).to_bytes(_STEP_KEY_BYTES, "big")


def _sender_ids(group_info: GroupInfo) -> list[Any]:
    """The group's peers that contribute tensors (all but auxiliaries), in group order."""
    modes = (AveragingMode(MSGPackSerializer.loads(g)[1]) for g in group_info.gathered)
    return [p for p, m in zip(group_info.peer_ids, modes, strict=True) if m != AveragingMode.AUX]
