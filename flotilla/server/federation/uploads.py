"""Device uploads: admitted by reservation or budget, one per device, checked before delivery.

An update reaches the core as an :class:`UploadHeader` plus an async iterator of byte
chunks, whatever edge carried it. Here its signature is checked first (the device's
registered key over job, round, round token, payload SHA-256 and a nonce not seen before:
``core.identity``), then it is bounded by size before any buffer exists, checked against
its SHA-256, decoded zero-copy against the model's layout, refused if not finite, and only
then handed to the round engine (``Gateway.deliver``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from flotilla.compression import Codec, NoneCodec, decode_state_with, max_payload_bytes
from flotilla.core.blobs import BlobAssembler
from flotilla.core.errors import (
    AuthError,
    FlotillaError,
    ForbiddenError,
    StaleRoundError,
    UpdateRejected,
    WireError,
)
from flotilla.core.events import EventSink, Fanout, UpdateAccepted, UpdateRefused
from flotilla.core.identity import digest_bytes, update_statement, verify_update
from flotilla.core.records import DeviceRecord
from flotilla.core.streams import paced
from flotilla.core.tensors import ModelState, TensorSpec, check_finite, decode_state, read_metadata
from flotilla.core.timeouts import Timeouts
from flotilla.core.update import Update
from flotilla.core.work import ReportVerdict, Reservation, RoundRef, UploadHeader
from flotilla.engine.backend import Reported, TrainTask
from flotilla.scheduling import DevicePool
from flotilla.server.federation.budget import ByteBudget
from flotilla.server.federation.gateway import Gateway, OpenRound

#: Room for a safetensors header beyond the raw tensor bytes of an update.
HEADER_SLACK = 1024 * 1024
#: Most members a server-less round's report may name.
MAX_GROUP = 4096
#: Header codec names that mean plain safetensors of the delta.
PLAIN_CODECS = {"": "none", "safetensors": "none"}
#: Signed uploads one device may start for one round (each with a fresh nonce): enough
#: for every honest retry, and a bound on the nonces kept for it.
MAX_ATTEMPTS = 64
#: The longest refusal detail an event carries (it is recorded).
MAX_DETAIL = 500


def decode_update(
    payload: memoryview, layout: tuple[TensorSpec, ...], codec: Codec, limit: int
) -> ModelState:
    """The delta in ``layout``, from plain safetensors or the job's codec payload.

    Plain safetensors (no codec metadata) is always accepted for ``none``: it is what any
    client in any language can write, and it decodes without a copy.
    """
    if codec.name == "none" and "codec" not in read_metadata(payload, limit):
        return decode_state(payload, expected=layout, max_bytes=limit)
    return decode_state_with(payload, layout, limit, codec=codec)


def update_limit(task: TrainTask, device_id: str = "") -> int:
    """Largest payload ``device_id`` may send for ``task``: checked before any buffer
    exists."""
    return max(
        sum(s.nbytes for s in task.layout) + HEADER_SLACK,
        max_payload_bytes(task.codec_for(device_id), task.layout),
    )


def checked_report(report: Reported) -> Reported:
    """A device's report, checked for shape (the engine checks whom it names)."""
    sha = report.model_sha256
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise WireError("model_sha256 must be 64 lowercase hex digits")
    if not 0 < len(report.contributors) <= MAX_GROUP:
        raise WireError(f"a report names 1 to {MAX_GROUP} contributors")
    seconds = report.allreduce_s
    return dataclasses.replace(
        report,
        group_id=report.group_id[:128],
        allreduce_s=seconds if math.isfinite(seconds) and seconds >= 0 else 0.0,
    )


#: How far an upload got before it was refused: what the refusal's reason is.
UploadStage = Literal["open", "header", "size", "room", "read", "decode", "finite", "deliver"]

_STAGE_REASONS: dict[str, str] = {
    "open": "stale",
    "header": "malformed",
    "size": "oversized",
    "room": "malformed",
    "read": "malformed",
    "decode": "malformed",
    "finite": "non_finite",
    "deliver": "refused",
}


@dataclass(slots=True)
class _Progress:
    stage: UploadStage = "open"
    #: Set by the identity checks, whose reasons no stage tells.
    reason: str = ""


def refusal_reason(stage: UploadStage, exc: FlotillaError) -> str:
    """The bounded label (``core.events.REFUSAL_REASONS``) for ``exc`` raised at ``stage``."""
    if isinstance(exc, StaleRoundError):
        return "late" if stage == "read" else "stale"
    if stage == "decode" and isinstance(exc, UpdateRejected):
        return "shape"  # decoded, but not the model's tensors
    return _STAGE_REASONS[stage]


class Standing(Protocol):
    """Whether a device is still trusted now (it may be revoked while it uploads)."""

    def revoked(self, device_id: str) -> bool: ...


class Nonces:
    """Nonces each device signed uploads with, kept per open round and dropped with it: a
    captured upload resent in its round is a replay; in any later round its round token
    (signed) is no longer open, so it is stale whatever its nonce."""

    def __init__(self, round_open: Callable[[str], bool]) -> None:
        self._round_open = round_open
        self._seen: dict[str, dict[str, set[bytes]]] = {}

    def take(self, round_token: str, device_id: str, nonce: bytes) -> None:
        """Remember ``nonce``; UpdateRejected if the device used it (or too many) before."""
        for token in [t for t in self._seen if not self._round_open(t)]:
            del self._seen[token]
        used = self._seen.setdefault(round_token, {}).setdefault(device_id, set())
        if nonce in used:
            raise UpdateRejected("replayed upload: this nonce was already used in this round")
        if len(used) >= MAX_ATTEMPTS:
            raise UpdateRejected(f"more than {MAX_ATTEMPTS} uploads for one round")
        used.add(nonce)


def check_signature(device: DeviceRecord, head: UploadHeader, progress: _Progress) -> None:
    """The update is this device's, for this job, round and bytes, or refused with why."""
    if not device.public_key:
        progress.reason = "no_key"
        raise AuthError(
            "this device registered no public key (it enrolled before updates were signed): "
            "enrol again to make one"
        )
    progress.stage = "header"
    digest = digest_bytes(head.payload_sha256)
    progress.reason = "signature"
    ref = head.ref
    if not head.nonce or not head.signature:
        raise UpdateRejected("unsigned update: every upload carries a nonce and a signature")
    statement = update_statement(ref.job_id, ref.round, ref.round_token, digest, head.nonce)
    if not verify_update(device.public_key, statement, head.signature):
        raise UpdateRejected(
            "the signature does not verify with this device's key over this job, round, "
            "round token, payload SHA-256 and nonce"
        )
    progress.reason = ""


class KeyedLock:
    """One asyncio lock per key, dropped when nobody holds or awaits it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


@dataclass(slots=True)
class _Held:
    device_id: str
    round_token: str
    size: int
    taken: int
    expiry: asyncio.TimerHandle


class Reservations:
    """Room in the upload budget, granted before an upload starts and held briefly.

    A device waits for room in a cheap call instead of with an upload stream open, where
    a transport would keep reading its data ahead into buffers. Room not used within
    ``ttl_s`` goes back to the budget; a device holds at most one reservation.
    """

    def __init__(self, budget: ByteBudget, ttl_s: float) -> None:
        self._budget = budget
        self.ttl_s = ttl_s
        self._held: dict[str, _Held] = {}
        self._returns: set[asyncio.Task[None]] = set()

    async def make(self, device_id: str, round_token: str, size: int) -> str:
        for key in [k for k, h in self._held.items() if h.device_id == device_id]:
            self._give_back(key)
        taken = await self._budget.acquire(size)
        key = secrets.token_hex(16)
        expiry = asyncio.get_running_loop().call_later(self.ttl_s, self._give_back, key)
        self._held[key] = _Held(device_id, round_token, size, taken, expiry)
        return key

    @contextlib.asynccontextmanager
    async def claim(self, key: str, device_id: str, head: UploadHeader) -> AsyncIterator[None]:
        held = self._held.pop(key, None)
        if held is None or held.device_id != device_id:
            raise WireError("unknown or expired upload reservation; reserve again")
        held.expiry.cancel()
        try:
            if held.round_token != head.ref.round_token or head.payload_size > held.size:
                raise WireError("the upload does not match its reservation")
            yield
        finally:
            await self._budget.release(held.taken)

    def _give_back(self, key: str) -> None:
        held = self._held.pop(key, None)
        if held is None:
            return
        held.expiry.cancel()
        task = asyncio.ensure_future(self._budget.release(held.taken))
        self._returns.add(task)
        task.add_done_callback(self._returns.discard)


class Uploads:
    """Takes devices' updates and server-less reports for the rounds the gateway holds open."""

    def __init__(
        self,
        gateway: Gateway,
        pool: DevicePool,
        budget: ByteBudget,
        timeouts: Timeouts,
        clock: Callable[[], float],
        standing: Standing,
        events: EventSink | None = None,
    ) -> None:
        """``timeouts.upload_idle_s`` drops a stalled upload (and bounds a reservation);
        ``timeouts.upload_grace_s`` lets one under way finish past its round's deadline;
        ``standing`` says whether a device was revoked meanwhile; ``events`` hears of every
        update taken or refused, and why."""
        self._events = Fanout(() if events is None else (events,))
        self._gateway = gateway
        self._pool = pool
        self._budget = budget
        self._idle_s = timeouts.upload_idle_s
        self._grace_s = timeouts.upload_grace_s
        self._clock = clock
        self._locks = KeyedLock()
        self._reservations = Reservations(budget, self._idle_s)
        self._standing = standing
        self._nonces = Nonces(gateway.round_open)

    async def reserve(self, device: DeviceRecord, ref: RoundRef, size: int) -> Reservation:
        """Room for an upload of ``size`` bytes, waited for until the round's deadline.
        A refusal here is the update's refusal (its device will not send it)."""
        progress = _Progress()
        device_id = device.id
        try:
            open_round = self._gateway.expect(device_id, ref.job_id, ref.round, ref.round_token)
            if not device.public_key:
                progress.reason = "no_key"
                raise AuthError("this device registered no public key: enrol again to make one")
            limit = update_limit(open_round.task, device_id)
            progress.stage = "size"
            if not 0 <= size <= limit:
                raise WireError(f"update of {size} bytes exceeds the limit of {limit}")
            progress.stage = "read"
            try:
                key = await asyncio.wait_for(
                    self._reservations.make(device_id, ref.round_token, size),
                    self._time_left(open_round.task.order.deadline),
                )
            except asyncio.TimeoutError:
                raise StaleRoundError(
                    "stale round: the round closes before there is room for this update"
                ) from None
        except FlotillaError as exc:
            self._refused(ref, device_id, progress, exc)
            raise
        return Reservation(key, self._reservations.ttl_s)

    def _refused(
        self, ref: RoundRef, device_id: str, progress: _Progress, exc: FlotillaError
    ) -> None:
        job = self._job_label(ref)
        reason = progress.reason or refusal_reason(progress.stage, exc)
        detail = str(exc)[:MAX_DETAIL]
        self._events.emit(UpdateRefused(job, device_id, reason, ref.round if job else -1, detail))

    def _job_label(self, ref: RoundRef) -> str:
        """The job a refusal is counted against: the one the device names if it is real,
        else empty (a device must not mint metric labels by naming made-up jobs)."""
        return ref.job_id if self._gateway.known_job(ref.job_id) else ""

    async def receive(
        self, device: DeviceRecord, head: UploadHeader, chunks: AsyncIterator[memoryview | bytes]
    ) -> None:
        """Take one update; returns once the engine accepted it, raises if it refused."""
        # One upload per device at a time: a device opening many streams at once would
        # otherwise get a model-sized buffer for each.
        async with self._locks.hold(device.id):
            progress = _Progress()
            try:
                await self._receive(device, head, chunks, progress)
            except FlotillaError as exc:
                self._refused(head.ref, device.id, progress, exc)
                raise
            self._events.emit(UpdateAccepted(head.ref.job_id, device.id, head.payload_size))

    async def _receive(
        self,
        device: DeviceRecord,
        head: UploadHeader,
        chunks: AsyncIterator[memoryview | bytes],
        progress: _Progress,
    ) -> None:
        device_id = device.id
        open_round = self._gateway.expect(
            device_id, head.ref.job_id, head.ref.round, head.ref.round_token
        )
        # Who sent it, before a byte of it is read: signed by this device's key, for this
        # job, round and payload, with a nonce it has not used in this round.
        check_signature(device, head, progress)
        progress.reason = "replay"
        self._nonces.take(head.ref.round_token, device_id, head.nonce)
        progress.reason = ""
        progress.stage = "header"
        codec = self._codec(open_round, device_id, head)
        if head.num_samples <= 0:
            raise UpdateRejected("num_samples must be positive")
        limit = update_limit(open_round.task, device_id)
        progress.stage = "size"
        if not 0 <= head.payload_size <= limit:
            raise WireError(f"update of {head.payload_size} bytes exceeds the limit of {limit}")
        progress.stage = "room"
        # The buffer is allocated only once the byte budget admits it (ahead of the stream,
        # with a reservation, or here), so memory is bounded however many devices upload
        # at once; a sender that stalls is dropped.
        room: contextlib.AbstractAsyncContextManager[object]
        if head.reservation:
            room = self._reservations.claim(head.reservation, device_id, head)
        else:
            room = self._budget.hold(head.payload_size)
        async with room:
            progress.stage = "read"
            assembler = BlobAssembler(head.payload_size, head.payload_sha256, limit)
            try:
                payload = await asyncio.wait_for(
                    self._read(chunks, assembler, device_id),
                    self._time_left(open_round.task.order.deadline),
                )
            except asyncio.TimeoutError:
                raise StaleRoundError(
                    "stale round: the round closed before this update finished uploading"
                ) from None
            progress.stage = "decode"
            delta = decode_update(payload, open_round.task.layout, codec, limit)
            # Refuse here, before delivery: a refusal from the engine would cost the device
            # its place in the round, so it could not send a corrected update.
            progress.stage = "finite"
            check_finite(delta)
            update = Update(
                job_id=head.ref.job_id,
                round=head.ref.round,
                device_id=device_id,
                num_samples=int(head.num_samples),
                delta=delta,
                metrics={
                    **head.metrics,
                    # Measured here, not reported: what this device cost the network.
                    "bytes_up": float(head.payload_size),
                    "bytes_down": float(open_round.bytes_down.get(device_id, 0)),
                },
            )
            if self._standing.revoked(device_id):
                progress.reason = "revoked"
                with contextlib.suppress(StaleRoundError):
                    self._gateway.give_up(device_id, head.ref, "revoked by the operator")
                raise ForbiddenError("this device was revoked while its update was uploading")
            progress.stage = "deliver"
            await self._gateway.deliver(
                open_round, update, self._time_left(open_round.task.order.deadline)
            )

    def _codec(self, open_round: OpenRound, device_id: str, head: UploadHeader) -> Codec:
        codec = open_round.task.codec_for(device_id)
        if open_round.task.transport == "p2p":
            self._gateway.expect_upload(open_round, device_id)
            codec = NoneCodec()  # the group's exact average, as the devices applied it
        sent = PLAIN_CODECS.get(head.codec, head.codec)
        if sent != codec.name:
            whose = "this device's" if device_id in open_round.task.device_codecs else "this job's"
            raise WireError(f"update codec {head.codec!r}; {whose} uplink codec is {codec.name!r}")
        return codec

    async def _read(
        self, chunks: AsyncIterator[memoryview | bytes], assembler: BlobAssembler, device_id: str
    ) -> memoryview:
        async for data in paced(chunks, self._idle_s, "upload"):
            assembler.add(data)
            self._pool.touch(device_id)
        return assembler.finish()

    async def report(
        self, device_id: str, ref: RoundRef, report: Reported, hold_s: float
    ) -> ReportVerdict:
        """A server-less round's report; the device is told whether to upload the average."""
        gateway = self._gateway
        try:
            open_round = gateway.expect(device_id, ref.job_id, ref.round, ref.round_token)
            if open_round.task.transport != "p2p":
                raise WireError("only server-less (p2p) rounds report; this one takes uploads")
            upload = gateway.report(open_round, checked_report(report))
            if not upload:
                upload = await gateway.hold_reporter(open_round, device_id, hold_s)
        except StaleRoundError:
            return ReportVerdict(upload=False, round_open=False)
        self._pool.touch(device_id)
        return ReportVerdict(upload=upload, round_open=gateway.round_open(ref.round_token))

    def _time_left(self, deadline: float) -> float:
        """Seconds an upload may still take: to the round's deadline, plus a little grace."""
        return max(1.0, deadline - self._clock() + self._grace_s)
