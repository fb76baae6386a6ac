"""The client agent: enrol, poll for rounds, train locally, upload the update, repeat.

It survives a server that goes away (capped, jittered backoff, then picks up where the new
server is), and leaves cleanly on Ctrl-C by telling the server. It talks to the server
through an :class:`~flotilla.client.transport.AgentTransport` (gRPC unless given another),
and decides on retries from the errors of ``flotilla.core.errors`` the transport raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import logging
import random
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from flotilla.client.backoff import Backoff
from flotilla.client.config import AgentConfig, rebuild_model
from flotilla.client.credentials import CredentialFile
from flotilla.client.secure import SecureRound
from flotilla.client.training import TrainOutcome, TrainWork
from flotilla.client.transport import (
    AgentTransport,
    AverageReport,
    DeviceCredential,
    Enrol,
    FetchModel,
    GiveUp,
    Heartbeat,
    Leave,
    Poll,
    ReportAverage,
    ReserveUpload,
    SpeedTest,
    SubmitUpdate,
)
from flotilla.core.allreduce import Contribution, GroupAveraging
from flotilla.core.blobs import BlobAssembler, iter_chunks
from flotilla.core.conditions import DeviceConditions
from flotilla.core.device import MAX_SAMPLES, DeviceProfile
from flotilla.core.eligibility import EligibilitySection, ineligibility
from flotilla.core.errors import (
    AuthError,
    FlotillaError,
    ForbiddenError,
    NotFoundError,
    Unreachable,
    UpdateRejected,
)
from flotilla.core.identity import DeviceIdentity, digest_bytes
from flotilla.core.measure import matmul_gflops, memory_bytes
from flotilla.core.round_config import RoundConfig, SecurePlan
from flotilla.core.work import UploadHeader, WorkOrder
from flotilla.secagg import SecAggRefused

log = logging.getLogger(__name__)

#: Pause before a reporter the server held and did not ask to upload reports again.
REREPORT_PAUSE_S = 0.1
#: Errors that refuse one request of a round: give the round up and poll again at once.
REFUSED = (UpdateRejected, NotFoundError)


class Agent:
    """One device's agent. ``run`` returns only when cancelled or refused.

    ``transport`` defaults to gRPC to ``config.server`` (``config.tls_ca`` for TLS); the
    agent closes it when ``run`` ends.
    """

    def __init__(
        self,
        config: AgentConfig,
        rng: random.Random | None = None,
        transport: AgentTransport | None = None,
    ) -> None:
        self.config = config
        self._rng = rng or random.Random()
        self._backoff = Backoff(self._rng, cap_s=config.backoff_cap_s)
        self._transport = transport if transport is not None else grpc_transport(config)
        self._saved = CredentialFile(config.state_dir, config.server)
        self._credential: DeviceCredential | None = None
        #: The key every upload is signed with, made at enrolment (``core.identity``).
        self._identity: DeviceIdentity | None = None
        self._model: tuple[str, memoryview] | None = None
        self._pending_profile: DeviceProfile | None = None
        #: The whole profile as last sent (measured at connect), which a new count changes.
        self._reported: DeviceProfile | None = None
        #: Task -> training samples its data holds, counted when the task first loaded it.
        self._samples: dict[str, int] = {}
        self._averager: GroupAveraging | None = None  # made at the first p2p round
        self._p2p = config.p2p
        self._peer_id = ""
        self._identity_dir: tempfile.TemporaryDirectory[str] | None = None
        self.rounds_done = 0

    @property
    def device_id(self) -> str | None:
        return self._credential.device_id if self._credential else None

    async def run(self) -> None:
        try:
            await self._connect()
            while True:
                await self._step()
        finally:
            await self._leave()
            await self._transport.aclose()
            if self._averager is not None:
                await asyncio.to_thread(self._averager.shutdown)
            if self._identity_dir is not None:
                self._identity_dir.cleanup()

    async def _connect(self) -> None:
        """Enrol (or reuse a saved credential) and measure the upload rate."""
        self._credential = self._saved.load()
        self._identity = self._saved.identity()
        if self._credential is not None and self._identity is None:
            log.warning("enrolled before updates were signed: enrolling again with a key")
            self._credential = None
        profile = await asyncio.to_thread(self._profile)
        self._peer_id = await asyncio.to_thread(self._p2p_identity)
        while self._credential is None:
            try:
                self._credential = await self._enrol(profile)
            except Unreachable as exc:
                await self._pause(f"server unreachable ({exc})")
        self._backoff.reset()
        upload = await self._speed_test()
        self._pending_profile = dataclasses.replace(profile, upload_bytes_per_s=upload)
        self._reported = self._pending_profile

    def _p2p_identity(self) -> str:
        """This device's hivemind peer id, made before its peer starts so the server can name
        it among a round's members; "" without the p2p extra (such a device never averages)."""
        if self._peer_id or importlib.util.find_spec("hivemind") is None:
            return self._peer_id
        from flotilla.client.peer_id import ensure_identity

        path = self.config.p2p.identity_path
        if path is None:  # no state dir: an identity for this run of the agent
            self._identity_dir = tempfile.TemporaryDirectory(prefix="flotilla-p2p-")
            path = Path(self._identity_dir.name) / "p2p-identity.key"
        self._p2p = dataclasses.replace(self.config.p2p, identity_path=path)
        return ensure_identity(path)

    def _profile(self) -> DeviceProfile:
        """Measured here; the server learns the device id when it enrols the device."""
        return DeviceProfile(
            device_id="",
            tasks=(self.config.trainer.task_name,),
            gflops=matmul_gflops(),
            memory_bytes=memory_bytes(),
            device_class=self.config.device_class,
            samples=dict(self._samples),
        )

    def _counted(self, held: int | None) -> None:
        """The samples the task's data holds, known once it loaded (the first round): a
        new count goes to the server with the next poll's profile."""
        task = self.config.trainer.task_name
        if held is None or self._samples.get(task) == min(held, MAX_SAMPLES):
            return
        self._samples[task] = min(held, MAX_SAMPLES)
        if self._reported is not None:
            self._reported = dataclasses.replace(self._reported, samples=dict(self._samples))
            self._pending_profile = self._reported

    async def _enrol(self, profile: DeviceProfile) -> DeviceCredential:
        identity = DeviceIdentity.generate()
        enrol = Enrol(
            self.config.token, profile, self.config.timeouts.enrol_s, identity.public_key_hex
        )
        try:
            credential = await self._transport.send(enrol)
        except AuthError as exc:
            raise AuthError(f"the server refused the enrolment token: {exc}") from exc
        self._identity = identity
        self._saved.save_identity(identity)
        self._saved.save(credential)
        log.info("enrolled as %s", credential.device_id)
        return credential

    @property
    def _me(self) -> DeviceCredential:
        assert self._credential is not None
        return self._credential

    async def _speed_test(self) -> float:
        payload = bytes(min(self.config.speed_test_bytes, 1024 * 1024))
        rounds = max(1, self.config.speed_test_bytes // len(payload))

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(rounds):
                yield payload

        start = time.perf_counter()
        try:
            sent = await self._transport.send(
                SpeedTest(self._me, chunks(), self.config.timeouts.transfer_s)
            )
        except FlotillaError as exc:
            log.warning("speed test failed (%s); reporting no upload rate", exc)
            return 0.0
        return float(sent) / max(time.perf_counter() - start, 1e-6)

    async def _pause(self, why: str) -> None:
        delay = self._backoff.next_delay()
        log.info("%s; retrying in %.1fs", why, delay)
        await asyncio.sleep(delay)

    async def _step(self) -> None:
        """One poll and, if it brings work, one round of it."""
        try:
            task = await self._poll()
            if task is not None:
                await self._work(task)
            self._backoff.reset()
        except ForbiddenError as exc:
            log.error("this device was revoked by the operator (%s); stopping", exc)
            self._credential = None  # nothing to say goodbye with
            raise
        except AuthError as exc:
            log.warning("credential refused (%s); enrolling again", exc)
            self._credential = None
            self._saved.forget()
            await self._connect()
        except Unreachable as exc:
            await self._pause(f"server unreachable ({exc})")
        except REFUSED as exc:
            log.warning("round refused: %s %s", type(exc).__name__, exc)
        except FlotillaError as exc:
            log.error("round failed on this device: %s", exc)
            await self._pause("after a failed round")

    def _conditions(self) -> DeviceConditions | None:
        source = self.config.conditions
        return None if source is None else source()

    async def _poll(self) -> WorkOrder | None:
        timeout_s = self.config.timeouts.poll_s
        poll = Poll(self._me, self._peer_id, self._pending_profile, timeout_s, self._conditions())
        task = await self._transport.send(poll)
        self._pending_profile = None
        return task

    async def _work(self, task: WorkOrder) -> None:
        config = RoundConfig.from_json(task.config_json)
        conditions = self._conditions()
        why = None if conditions is None else ineligibility(config.eligibility, None, conditions)
        if why is not None:  # changed since the poll that brought the task
            await self._give_up(task, why, conditions)
            return
        # Heartbeats run for the whole round, transfers included: a slow link must not
        # look like a dead device. They also watch the device's conditions.
        round_open = asyncio.Event()
        round_open.set()
        beat = asyncio.ensure_future(self._heartbeat(task, config.eligibility, round_open))
        try:
            model = await self._fetch(task)
            if not round_open.is_set():
                return  # given up while downloading
            work = TrainWork(task.job_id, int(task.seed), config, task.uplink_codec)
            outcome = await asyncio.to_thread(self.config.trainer.train, model, work)
            self._counted(outcome.samples_held)
            if not round_open.is_set():
                log.info(
                    "round %d of %s closed while training; not uploading", task.round, task.job_id
                )
                return
            if config.secagg is not None and outcome.delta is not None:
                del model
                await self._secure(task, config.secagg, outcome)
                return
            if outcome.delta is not None:
                await self._average(task, model, outcome, round_open)
                return
            del model  # the cache keeps it when wanted; an upload can take a while
            await self._submit(task, outcome)
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError, FlotillaError):
                await beat
        self.rounds_done += 1

    async def _secure(self, task: WorkOrder, plan: SecurePlan, outcome: TrainOutcome) -> None:
        """A secure round: mask the update and answer every stage; a device that stops
        (SecAggRefused) gives the round up with the reason."""
        assert outcome.delta is not None and self.device_id and self._identity is not None
        secure = SecureRound.start(
            task, plan, self.device_id, self._identity.key, outcome.delta, outcome.num_samples,
            self.config.secagg_device,
        )  # fmt: skip
        try:
            await secure.run(self._transport, self._me)
        except SecAggRefused as exc:
            log.warning("round %d of %s: secure round stopped: %s", task.round, task.job_id, exc)
            give_up = GiveUp(
                self._me, task.ref, f"secagg: {exc.reason}", self.config.timeouts.heartbeat_s
            )
            with contextlib.suppress(FlotillaError):
                await self._transport.send(give_up)
            return
        log.info("round %d of %s: secure round done", task.round, task.job_id)

    def _make_averaging(self, job_id: str) -> GroupAveraging:
        if self.config.averaging is not None:
            return self.config.averaging(self._p2p)
        try:
            from flotilla.p2p.federated import UpdateAverager
        except ImportError as exc:
            raise FlotillaError(
                f"job {job_id} averages peer to peer: this device needs the p2p extra "
                f"(pip install 'flotilla[p2p]'): {exc}"
            ) from exc
        return UpdateAverager(self._p2p)

    async def _average(
        self,
        task: WorkOrder,
        model: memoryview,
        outcome: TrainOutcome,
        round_open: asyncio.Event,
    ) -> None:
        """A server-less round: all-reduce with the group, report the model it agreed on,
        upload the average when asked; until the round closes, in case the server asks."""
        config = RoundConfig.from_json(task.config_json)
        assert config.p2p is not None and outcome.delta is not None and self.device_id
        if self._averager is None:
            self._averager = self._make_averaging(task.job_id)
        me = Contribution(self.device_id, outcome.num_samples, outcome.metrics)
        left = task.deadline - time.time() - self.config.timeouts.report_margin_s
        token = task.round_token[:8]  # the group key is a secret: log only its start
        log.info("round %d of %s: averaging in group %s...", task.round, task.job_id, token)
        agreed = await asyncio.to_thread(
            self._averager.agree, task.round_token, model, outcome.delta, me, left, config
        )
        log.info(
            "round %d of %s: agreed model %s with %d contributors",
            task.round, task.job_id, agreed.model_sha256, len(agreed.contributors),
        )  # fmt: skip
        report = AverageReport(
            model_sha256=agreed.model_sha256,
            group_id=agreed.group_id,
            contributors=tuple(agreed.contributors),
            allreduce_s=agreed.seconds,
            reverted=agreed.reverted,
        )
        timeouts = self.config.timeouts
        hold_s = timeouts.report_hold_s + timeouts.heartbeat_s
        while round_open.is_set() and time.time() < task.deadline:
            reply = await self._transport.send(ReportAverage(self._me, task.ref, report, hold_s))
            if reply.upload:
                upload = TrainOutcome(outcome.num_samples, outcome.metrics, agreed.upload)
                await self._submit(task, upload)
                return
            if not reply.round_open:
                return
            await asyncio.sleep(REREPORT_PAUSE_S)

    async def _heartbeat(
        self, task: WorkOrder, policy: EligibilitySection, round_open: asyncio.Event
    ) -> None:
        """Until cancelled: say the device is alive, with its conditions; clear
        ``round_open`` when the round closes or the device stops qualifying for it (then
        the round is given up at once, so the server need not wait for its deadline)."""
        timeouts = self.config.timeouts
        while True:
            await asyncio.sleep(timeouts.heartbeat_every_s)
            conditions = self._conditions()
            why = None if conditions is None else ineligibility(policy, None, conditions)
            if why is not None:
                round_open.clear()
                await self._give_up(task, why, conditions)
                return
            beat = Heartbeat(self._me, task.round_token, timeouts.heartbeat_s, conditions)
            with contextlib.suppress(FlotillaError):
                if not await self._transport.send(beat):
                    round_open.clear()
                    return

    async def _give_up(
        self, task: WorkOrder, why: str, conditions: DeviceConditions | None = None
    ) -> None:
        """Tell the server this device drops out of ``task``'s round because of ``why`` (a
        condition), then what its conditions are now, so no job selects it again until
        they change; the training already running in its thread finishes unused."""
        log.info("round %d of %s: giving up, %s", task.round, task.job_id, why)
        timeout_s = self.config.timeouts.heartbeat_s
        give_up = GiveUp(self._me, task.ref, f"conditions: {why}", timeout_s)
        with contextlib.suppress(FlotillaError):  # the round may have closed meanwhile
            await self._transport.send(give_up)
        if conditions is not None:
            with contextlib.suppress(FlotillaError):
                await self._transport.send(
                    Heartbeat(self._me, task.round_token, timeout_s, conditions)
                )

    async def _fetch(self, task: WorkOrder) -> memoryview:
        if self._model is not None and self._model[0] == task.model_sha256:
            return self._model[1]
        data: memoryview | None = None
        held = self._model
        if held is not None and task.delta_sha256 and held[0] == task.delta_base_sha256:
            data = await self._fetch_delta(task, held[1])
        if data is None:
            data = await self._fetch_blob(task, task.model_sha256, task.model_size)
        self._model = (task.model_sha256, data)
        return data

    async def _fetch_blob(self, task: WorkOrder, sha256: str, size: int) -> memoryview:
        if size > self.config.max_model_bytes:
            raise FlotillaError(f"model of {size} bytes is over this device's limit")
        assembler = BlobAssembler(size, sha256, self.config.max_model_bytes)
        fetch = FetchModel(self._me, task.job_id, sha256, self.config.timeouts.transfer_s)
        async for chunk in await self._transport.send(fetch):
            assembler.add(chunk)
        return assembler.finish()

    async def _fetch_delta(self, task: WorkOrder, base: memoryview) -> memoryview | None:
        """The new model rebuilt from the one held plus the broadcast delta, or None (then
        the whole model is fetched) when the rebuild does not hash to the server's."""
        delta = await self._fetch_blob(task, task.delta_sha256, task.delta_size)
        try:
            return await asyncio.to_thread(rebuild_model, base, delta, task)
        except FlotillaError as exc:
            log.warning("downlink delta unusable (%s); fetching the whole model", exc)
            return None

    async def _submit(self, task: WorkOrder, outcome: TrainOutcome) -> None:
        # Wait for room on the server first (while heartbeats go on), then stream at once.
        size = len(outcome.payload)
        grace_s = self.config.timeouts.upload_grace_s
        wait_s = max(1.0, task.deadline - time.time() + grace_s)
        reserved = await self._transport.send(ReserveUpload(self._me, task.ref, size, wait_s))
        header = UploadHeader(
            ref=task.ref,
            num_samples=outcome.num_samples,
            payload_size=size,
            payload_sha256=outcome.payload_sha256,
            codec=outcome.codec,
            metrics=outcome.metrics,
            reservation=reserved.key,
        )
        if self._identity is not None:
            ref = task.ref
            signed = self._identity.sign_update(
                ref.job_id, ref.round, ref.round_token, digest_bytes(outcome.payload_sha256)
            )
            header = dataclasses.replace(header, nonce=signed.nonce, signature=signed.signature)

        async def chunks() -> AsyncIterator[memoryview]:
            for piece in iter_chunks(outcome.payload):
                yield piece

        submit = SubmitUpdate(self._me, header, chunks(), self.config.timeouts.transfer_s)
        receipt = await self._transport.send(submit)
        log.info("round %d of %s: %s", task.round, task.job_id, receipt.detail)

    async def _leave(self) -> None:
        if self._credential is None:
            return
        with contextlib.suppress(FlotillaError, asyncio.CancelledError):
            leave = Leave(self._me, "agent stopped", self.config.timeouts.leave_s)
            await self._transport.send(leave)


def grpc_transport(config: AgentConfig) -> AgentTransport:
    """The default transport: gRPC to ``config.server``. Imported here, so an agent on
    another transport (tests, in-process) never loads grpc."""
    from flotilla.client.grpc_transport import GrpcTransport

    return GrpcTransport(config.server, config.tls_ca, config.tls_cert, config.tls_key)
