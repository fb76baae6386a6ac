"""One secure round's stage exchange: devices' SecAgg+ messages in, the next stage's out.

A device sends its message for the open stage and waits; the stage closes when every
participant still in the round has answered or its time is up, and each device that
answered gets its message for the next stage. The :class:`~flotilla.secagg.SecAggServer`
does the cryptography; this module only decides when stages close and who is still in.

The server needs the devices' Ed25519 identity keys to check their signed key
advertisements. It asks :class:`DeviceKeys` for them when the first stage closes, for the
devices that advertised (so a device may register its key as late as its advertisement).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from flotilla.core.errors import StaleRoundError, WireError
from flotilla.secagg import (
    MaskedSum,
    SecAggAborted,
    SecAggConfig,
    SecAggMessageError,
    SecAggServer,
    Session,
    Stage,
)

log = logging.getLogger(__name__)

#: Room for a stage's message beyond the masked vector: keys, shares, signatures.
MESSAGE_OVERHEAD_BYTES = 64 * 1024
#: Per participant (encrypted shares, survivor lists) in a stage's message.
PER_PEER_BYTES = 1024
#: How much longer than the stage a device's wait for its reply may last.
REPLY_SLACK_S = 5.0


class DeviceKeys(Protocol):
    """Where the server reads devices' raw 32-byte Ed25519 public keys."""

    async def device_keys(self, device_ids: Sequence[str]) -> Mapping[str, bytes]: ...


def max_message_bytes(length: int, participants: int) -> int:
    """The largest stage message a device of such a round may send (8-byte integers)."""
    return 8 * (length + 1) + PER_PEER_BYTES * participants + MESSAGE_OVERHEAD_BYTES


class StageExchange:
    """The stages of one secure round, between its devices and its SecAggServer."""

    def __init__(
        self,
        config: SecAggConfig,
        session: Session,
        keys: DeviceKeys,
        length: int,
        first_close: Callable[[], float],
    ) -> None:
        """``length``: values in the flat update (bounds every message);
        ``first_close()``: seconds until the first stage closes at the latest (devices
        train before they advertise, so it closes at the round's deadline)."""
        self.config = config
        self._first_close = first_close
        self.session = session
        self._keys = keys
        self._length = length
        self._limit = max_message_bytes(length, len(session.participants))
        self._server: SecAggServer | None = None
        #: Participants still in the round (not dropped, not silent at a stage's close).
        self.live: set[str] = set(session.participants)
        self.stage = Stage.ADVERTISE
        #: Who answered the open stage (ADVERTISE: with the body, kept until it closes).
        self._answered: dict[str, bytes] = {}
        self._all_in = asyncio.Event()
        self._replies: asyncio.Future[Mapping[str, bytes]] = _future()
        self._aborted: SecAggAborted | None = None
        #: True while a stage closes (in a worker thread): no message is taken meanwhile.
        self._closing = False
        #: Devices that dropped out, by the stage they left in.
        self.dropped: dict[str, Stage] = {}

    @property
    def participants(self) -> tuple[str, ...]:
        return self.session.participants

    def reply_wait_s(self) -> float:
        """How long a device waits for its reply to the open stage, at most."""
        wait = self.config.stage_timeout_s + REPLY_SLACK_S
        if self.stage == Stage.ADVERTISE:
            wait += max(self._first_close(), 0.0)
        return wait

    async def exchange(self, device_id: str, stage: int, body: bytes) -> bytes:
        """Take ``device_id``'s message for ``stage`` and return its message for the next
        stage once this one closes (b"" after the last). WireError: malformed, oversized,
        duplicate or out of stage; StaleRoundError: not (or no longer) in the round, or
        the round was aborted."""
        if device_id not in self.session.participants:
            raise StaleRoundError("this device is not a participant of the secure round")
        if self._aborted is not None:
            raise StaleRoundError(f"the secure round was aborted: {self._aborted}")
        if device_id not in self.live:
            raise StaleRoundError("this device is no longer in the secure round")
        if self._closing:
            raise StaleRoundError(f"stage {self.stage.name} of the secure round has closed")
        if len(body) > self._limit:
            raise WireError(f"a secure-round message is at most {self._limit} bytes")
        if stage != self.stage:
            raise WireError(f"the secure round is at stage {self.stage.name}, not stage {stage}")
        if device_id in self._answered:
            raise WireError(f"this device already answered stage {self.stage.name}")
        if self.stage != Stage.ADVERTISE:
            try:
                assert self._server is not None
                self._server.accept(device_id, self.stage, body)
            except SecAggMessageError as exc:
                raise WireError(f"secure round, stage {self.stage.name}: {exc.reason}") from exc
        wait_s = self.reply_wait_s()
        self._answered[device_id] = body if self.stage == Stage.ADVERTISE else b""
        self._check_all_in()
        try:
            replies = await asyncio.wait_for(asyncio.shield(self._replies), wait_s)
        except asyncio.TimeoutError:
            raise StaleRoundError("the secure round's stage did not close in time") from None
        reply = replies.get(device_id)
        if reply is None:
            raise StaleRoundError("the secure round went on without this device")
        return reply

    def drop(self, device_id: str) -> None:
        """``device_id`` left the round (failed, silent, gone): no stage waits for it."""
        if device_id in self.live:
            self.live.discard(device_id)
            self.dropped[device_id] = self.stage
            self._check_all_in()

    def _check_all_in(self) -> None:
        if self.live <= self._answered.keys():
            self._all_in.set()

    async def run_stage(self, timeout_s: float) -> None:
        """Wait for the open stage's messages (all in, or ``timeout_s``), close it and hand
        out the next stage's messages. SecAggAborted when the round cannot complete (then
        every waiting device hears it)."""
        stage = self.stage
        if timeout_s > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._all_in.wait(), timeout_s)
        for device_id in self.live - self._answered.keys():
            self.dropped[device_id] = stage  # silent at the close: out from here on
        self.live &= self._answered.keys()
        answered, self._answered = self._answered, {}
        self._closing = True
        try:
            if stage == Stage.ADVERTISE:
                await self._open_server(answered)
            assert self._server is not None
            replies = await asyncio.to_thread(self._server.close, stage)
        except SecAggAborted as exc:
            self._abort(exc)
            raise
        finally:
            self._closing = False
        if stage == Stage.UNMASK:
            replies = {d: b"" for d in answered if d in self.live}
        self.live &= replies.keys()
        done, self._replies = self._replies, _future()
        done.set_result(dict(replies))
        self._all_in = asyncio.Event()
        if stage != Stage.UNMASK:
            self.stage = Stage(stage + 1)
            self._check_all_in()
        log.debug(
            "secure round %s/%d: stage %s closed with %d of %d",
            self.session.job_id, self.session.round, stage.name, len(answered),
            len(self.session.participants),
        )  # fmt: skip

    async def _open_server(self, advertised: Mapping[str, bytes]) -> None:
        keys = dict(await self._keys.device_keys(sorted(advertised)))
        known = set(keys)
        for device_id in self.session.participants:
            if device_id not in keys:  # never verified against: it did not advertise or
                keys[device_id] = _unusable_key()  # is dropped just below
        server = SecAggServer(self.config, self.session, keys, length=self._length)
        for device_id, body in advertised.items():
            if device_id not in known:
                log.warning(
                    "secure round %s/%d: %s advertised without an identity key",
                    self.session.job_id, self.session.round, device_id,
                )  # fmt: skip
                self.live.discard(device_id)
                self.dropped[device_id] = Stage.ADVERTISE
                continue
            try:
                server.accept(device_id, Stage.ADVERTISE, body)
            except SecAggMessageError as exc:
                log.warning(
                    "secure round %s/%d: advertisement of %s refused (%s)",
                    self.session.job_id, self.session.round, device_id, exc.reason,
                )  # fmt: skip
                self.live.discard(device_id)
                self.dropped[device_id] = Stage.ADVERTISE
        self._server = server

    def _abort(self, exc: SecAggAborted) -> None:
        self._aborted = exc
        if not self._replies.done():
            self._replies.set_result({})

    def abort(self, detail: str) -> None:
        """End the round from outside (it closed, the job stops): waiting devices hear it."""
        if self._aborted is None:
            self._abort(SecAggAborted("out of stage", detail))

    def result(self) -> MaskedSum:
        assert self._server is not None
        return self._server.result()


def _unusable_key() -> bytes:
    """A public key whose private half is thrown away: no signature verifies against it."""
    return Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def _future() -> asyncio.Future[Mapping[str, bytes]]:
    return asyncio.get_running_loop().create_future()
