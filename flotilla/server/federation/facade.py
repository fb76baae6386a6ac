"""The federation, whichever edge reaches it: one method per thing a device or operator does.

Edges (gRPC in ``flotilla.server.grpc``, HTTP later) authenticate callers through this
facade, convert their messages to the values in :mod:`.views` and back, and map the
:mod:`flotilla.core.errors` it raises to their own status codes. Nothing here knows a
transport.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flotilla.core.access import Scope
from flotilla.core.blobs import CHUNK_BYTES
from flotilla.core.blobstore import BlobStore
from flotilla.core.conditions import DeviceConditions
from flotilla.core.device import DeviceProfile
from flotilla.core.errors import (
    AuthError,
    NotFoundError,
    Redirected,
    StaleRoundError,
    WireError,
)
from flotilla.core.events import BytesSent, DeviceChanged, EventSink, Fanout, PollAnswered
from flotilla.core.records import DeviceRecord, JobRecord, RefusalRecord, RoundRecord
from flotilla.core.timeouts import Timeouts
from flotilla.core.work import DeviceCredential, ReportVerdict, Reservation, RoundRef, UploadHeader
from flotilla.engine import EngineConfig, EngineServices, TaskRuntime
from flotilla.engine.backend import Reported, TrainTask
from flotilla.scheduling import Arbiter, DevicePool, KnobTrial, Leases
from flotilla.secagg import Stage
from flotilla.server.federation import auth
from flotilla.server.federation.budget import ByteBudget
from flotilla.server.federation.devices import Devices
from flotilla.server.federation.failures import FailureCounts
from flotilla.server.federation.gateway import Gateway
from flotilla.server.federation.jobs import Jobs
from flotilla.server.federation.peercert import PeerCertificate, check_bound
from flotilla.server.federation.placement import FencedLedger, JobPlacement
from flotilla.server.federation.ports import Hosted
from flotilla.server.federation.ratelimit import RateLimiter, RateLimits
from flotilla.server.federation.refusals import RefusalLog
from flotilla.server.federation.store import Store
from flotilla.server.federation.uploads import Uploads
from flotilla.server.federation.views import BlobSlice, DeviceInfo, JobDetail, VolunteerRunInfo

log = logging.getLogger(__name__)

#: The longest reason a device may give for giving up a round (it is logged and recorded).
MAX_REASON = 500
#: The stages of a secure round (``flotilla.secagg.Stage``: ADVERTISE .. UNMASK).
MIN_STAGE, MAX_STAGE = int(Stage.ADVERTISE), int(Stage.UNMASK)


@dataclass(frozen=True, slots=True)
class FederationConfig:
    state_dir: Path
    timeouts: Timeouts
    engine: EngineConfig
    #: Model downloads streamed at once; the rest wait (each holds transport buffers).
    download_slots: int = 2
    download_chunk_bytes: int = CHUNK_BYTES
    #: Per-device polls and uploads, per-address enrolments (``ratelimit``).
    rate_limits: RateLimits = field(default_factory=RateLimits)
    #: Mutual TLS: every device call must come with a client certificate naming the
    #: device (``peercert``); the edges verify the chain.
    client_certs: bool = False


class Federation:
    """Devices, jobs, uploads and blobs over one store, pool and gateway."""

    def __init__(
        self,
        config: FederationConfig,
        store: Store,
        upload_budget: ByteBudget,
        hosted: Hosted,
        tasks: TaskRuntime,
        clock: Callable[[], float] = time.time,
        sinks: Sequence[EventSink] = (),
    ) -> None:
        """``sinks`` hear every event (``core.events``) the federation and its jobs emit:
        Prometheus metrics, the dashboard's live feed. One that raises is logged, never
        felt by the caller."""
        self._failures = FailureCounts()
        self._refusals = RefusalLog(store, clock)
        self._events = Fanout((self._failures, self._refusals, *sinks))
        self._config = config
        self._store = store
        self._blobs = BlobStore(config.state_dir / "blobs")
        self._pool = DevicePool(clock=clock)
        self._leases = Leases(self._pool)
        self._gateway = Gateway(self._pool, clock, self._leases)
        engine = config.engine
        self._arbiter = Arbiter(
            self._pool,
            clock,
            engine.selection_grace_s,
            engine.idle_poll_s,
            joint=engine.joint_assignment,
        )
        self._hosted = hosted
        self._devices = Devices(store, self._pool, clock, self._events)
        self._uploads = Uploads(
            self._gateway,
            self._pool,
            upload_budget,
            config.timeouts,
            clock,
            self._devices,
            self._events,
        )
        self._placement = JobPlacement(
            store,
            config.timeouts.job_lease_s,
            clock,
            wanted=self._arbiter.shortfall,
            on_tick=self._on_tick,
        )
        #: Idle devices to send on to the deployment's other servers at their next poll.
        self._moving: set[str] = set()
        services = EngineServices(
            backend=self._gateway,
            leases=self._leases,
            arbiter=self._arbiter,
            ledger=FencedLedger(store, self._placement),
            blobs=self._blobs,
            clock=clock,
            config=engine,
            p2p=hosted.rendezvous,
            events=self._events,
            keys=self._devices,
        )
        self._jobs = Jobs(
            services,
            store,
            tasks,
            config.state_dir,
            config.timeouts.outage_backoff_max_s,
            holds=self._placement.holds,
            claim=self._placement.claim,
        )
        self._download_slots = asyncio.Semaphore(config.download_slots)
        self._limits = RateLimiter(config.rate_limits)
        #: Operator-API tokens seen valid, as (hash, scope): tokens are never revoked, so a
        #: request costs no query once its token has been seen.
        self._known_tokens: list[tuple[str, Scope]] = []

    async def start(self) -> None:
        """Join the deployment: take this server's share of the unfinished jobs (all of
        them when it is alone) and run them (``federation.placement``)."""
        await self._devices.start()
        self._refusals.start()
        await self._jobs.recall_lessons()
        await self._placement.start()

    async def close(self) -> None:
        # The leases first: no tick may restart runners after this. Ended, another server
        # may take the jobs while the runners stop; their commits would be refused
        # (fenced), never doubled.
        await self._placement.stop()
        await self._jobs.stop()
        self._gateway.close()
        await self._arbiter.close()
        await self._refusals.close()

    async def _on_tick(self, held: frozenset[str]) -> None:
        """Run the jobs this server holds, stop the rest; then pick idle devices the
        other servers' jobs lack."""
        await self._jobs.sync(held)
        self._plan_moves()

    def _plan_moves(self) -> None:
        """Mark idle devices this server's waiting jobs do not need, up to what the
        deployment's other servers lack per task, and end their held polls: at their next
        poll they are sent on (:class:`Redirected`)."""
        self._moving.clear()
        for task, lacking in sorted(self._placement.wanted_elsewhere().items()):
            spare = min(lacking, self._arbiter.surplus(task))
            for profile in self._arbiter.idle(task):
                if spare <= 0:
                    break
                if profile.device_id in self._moving:
                    continue
                self._moving.add(profile.device_id)
                self._placement.sent(task)
                self._gateway.wake(profile.device_id)
                spare -= 1

    def _send_on(self, device_id: str) -> None:
        """Redirected, if the device was picked to go to another server and is still free
        here: it leaves this server (nothing here will select it) and polls the next."""
        if device_id not in self._moving:
            return
        self._moving.discard(device_id)
        if self._gateway.offered(device_id) or not self._arbiter.is_free(device_id):
            return
        self._gateway.leave(device_id, "sent to another server of the deployment")
        self._events.emit(DeviceChanged(device_id, "offline"))
        log.info("device %s sent on: another server's jobs lack devices", device_id)
        raise Redirected(
            "another server of this deployment runs jobs that lack devices: try the next server"
        )

    def reap(self) -> list[str]:
        """Drop devices silent for longer than the liveness window; their ids."""
        gone = self._gateway.reap(self._config.timeouts.liveness_s)
        for device_id in gone:
            self._events.emit(DeviceChanged(device_id, "offline"))
        return gone

    # --- callers -------------------------------------------------------------------------

    async def enrol(
        self,
        token: str,
        profile: DeviceProfile,
        public_key: str = "",
        *,
        cert: PeerCertificate | None = None,
        address: str = "",
    ) -> DeviceCredential:
        """A new device. ``public_key`` (hex Ed25519) verifies its updates' signatures;
        ``cert``: its verified client certificate, whose name becomes the device id (mutual
        TLS); ``address``: where the call came from, whose enrolments are rate limited."""
        if address:
            self._limits.take("enrol", address)
        if cert is None and self._config.client_certs:
            check_bound(None, "", required=True)
        device_id = cert.device_id() if cert is not None else None
        return await self._devices.enrol(token, profile, device_id, public_key)

    async def authenticate_device(
        self, device_id: str | None, secret: str | None, cert: PeerCertificate | None = None
    ) -> DeviceRecord:
        """The device the credential names; with mutual TLS, only with its own certificate."""
        if self._config.client_certs:
            check_bound(cert, device_id or "", required=True)
        return await self._devices.authenticate(device_id, secret)

    @property
    def rate_limits(self) -> RateLimits:
        return self._config.rate_limits

    async def authenticate_operator(self, token: str | None) -> None:
        if not token or not await self._store.has_operator_token(auth.hash_secret(token)):
            raise AuthError("operator token refused")

    async def authenticate(self, token: str | None) -> Scope:
        """What an operator-API token (the HTTP edge's bearer) may do: ``OPERATOR`` or
        ``READ``. Enrolment tokens and device credentials are not operator-API tokens."""
        if not token:
            raise AuthError(
                "this route needs a token: send 'Authorization: Bearer TOKEN' with the "
                "operator token (STATE_DIR/operator.token) or a read token "
                "('flotilla server token create --read-only')"
            )
        granted = None
        for known_hash, scope in self._known_tokens:  # each compared in constant time
            if auth.matches(token, known_hash):
                granted = scope
        if granted is not None:
            return granted
        digest = auth.hash_secret(token)
        stored = await self._store.token_scope(digest)
        if stored is None:
            raise AuthError("token refused: it is neither the operator token nor a read token")
        scope = Scope(stored)
        self._known_tokens.append((digest, scope))
        return scope

    # --- a device's side -----------------------------------------------------------------

    async def poll(
        self,
        device: DeviceRecord,
        profile: DeviceProfile | None,
        p2p_peer_id: str = "",
        conditions: DeviceConditions | None = None,
    ) -> TrainTask | None:
        """The device's next task, waited for a while; None when there is none yet.
        ``conditions`` (battery, power, network; None: as it last said) decide which jobs
        may select it, and give up a round it was offered that its job's
        ``[eligibility]`` no longer admits. A device over its poll rate is RateLimited; one
        this server sends to another of its deployment is Redirected."""
        self._limits.take("poll", device.id)
        if p2p_peer_id:
            self._hosted.rendezvous.peer_seen(device.id, p2p_peer_id)
        await self._devices.seen(device, profile)
        self._send_on(device.id)
        if conditions is not None:
            self._conditions(device, conditions)
        timeouts = self._config.timeouts
        # A held poll is a live device: hold it for less than the liveness window, so the
        # reaper never drops an agent that is simply waiting for work.
        hold_s = min(timeouts.poll_hold_s, timeouts.liveness_s / 2)
        began = time.perf_counter()
        task = await self._gateway.poll(device.id, hold_s)
        self._events.emit(PollAnswered(time.perf_counter() - began))
        return task

    def heartbeat(
        self, device: DeviceRecord, round_token: str, conditions: DeviceConditions | None = None
    ) -> bool:
        """A training device is alive; whether its round is still open (for this device:
        closed once ``conditions`` no longer meet its job's ``[eligibility]``)."""
        back = not self._pool.is_online(device.id)
        self._pool.touch(device.id)
        if back and self._pool.is_online(device.id):
            self._events.emit(DeviceChanged(device.id, "online"))
        if conditions is not None and round_token in self._conditions(device, conditions):
            return False
        return self._gateway.round_open(round_token)

    def _conditions(self, device: DeviceRecord, conditions: DeviceConditions) -> set[str]:
        """Keep the device's latest conditions and give up the rounds they end; the
        round tokens given up."""
        self._pool.report(device.id, conditions)
        ended = self._gateway.judge(device.id, conditions)
        for ref in ended:
            log.info(
                "device %s dropped out of round %s of job %s: its conditions changed",
                device.id, ref.round, ref.job_id,
            )  # fmt: skip
        return {ref.round_token for ref in ended}

    async def fetch_model(
        self, device: DeviceRecord, sha256: str
    ) -> AsyncGenerator[BlobSlice, None]:
        """The model (or delta) a device's open round assigned it, chunk by chunk."""
        if not self._gateway.assigned_model(device.id, sha256):
            raise StaleRoundError("stale round: that model is not assigned to this device")
        job_id = self._gateway.assigned_job(device.id, sha256)
        sent = 0
        try:
            async for piece in self._stream_blob(sha256):
                self._gateway.count_download(device.id, sha256, len(piece.data))
                sent += len(piece.data)
                yield piece
                self._pool.touch(device.id)  # a long download is a sign of life
        finally:
            self._events.emit(BytesSent(job_id, sent))

    async def reserve_upload(self, device: DeviceRecord, ref: RoundRef, size: int) -> Reservation:
        """Room for an update; a device over its upload rate is RateLimited."""
        self._limits.take("upload", device.id)
        return await self._uploads.reserve(device, ref, size)

    async def submit_update(
        self, device: DeviceRecord, header: UploadHeader, chunks: AsyncIterator[memoryview | bytes]
    ) -> None:
        """Returns once the round took the update; raises why it did not."""
        await self._uploads.receive(device, header, chunks)

    async def report_average(
        self, device: DeviceRecord, ref: RoundRef, report: Reported
    ) -> ReportVerdict:
        hold_s = self._config.timeouts.report_hold_s
        return await self._uploads.report(device.id, ref, report, hold_s)

    async def secagg(
        self,
        device: DeviceRecord,
        ref: RoundRef,
        stage: int,
        body: bytes,
    ) -> bytes:
        """One device's message for a stage of a secure round; its message for the next
        stage once this one closes (bounded: the stage's timeout plus slack). A device not
        in the round, a closed round: StaleRoundError; a bad stage, an oversized or
        malformed body: WireError. Key advertisements are checked against the key the
        device registered at enrolment (``Devices.device_keys``)."""
        if not MIN_STAGE <= stage <= MAX_STAGE:
            raise WireError(f"a secure-round stage is {MIN_STAGE} to {MAX_STAGE}, not {stage}")
        return await self._gateway.secagg(device.id, ref, stage, body)

    def report_failure(self, device: DeviceRecord, ref: RoundRef, reason: str) -> None:
        """The device gives up its round with a reason (unplugged, on a metered network,
        training failed); the round counts it as a dropout at once, with reason
        ``conditions`` when ``reason`` names one (what ``core.eligibility.ineligibility``
        says: "not charging", "network metered, unmetered required"...)."""
        if len(reason) > MAX_REASON:
            raise WireError(f"a reason is at most {MAX_REASON} characters")
        self._gateway.give_up(device.id, ref, f"reported: {reason or 'no reason given'}")
        log.info(
            "device %s gave up round %s of job %s (%s)", device.id, ref.round, ref.job_id, reason
        )

    def leave(self, device: DeviceRecord, reason: str) -> None:
        self._gateway.leave(device.id, reason or "no reason given")
        self._events.emit(DeviceChanged(device.id, "offline"))
        log.info("device %s left (%s)", device.id, reason)

    # --- an operator's side --------------------------------------------------------------

    async def revoke_device(self, device_id: str) -> DeviceRecord:
        """Revoke a device at once: its credential and key stop working on every edge, the
        rounds it owes are given up (reason ``revoked``) and an update it is uploading is
        refused. NotFoundError for an unknown device."""
        record = await self._devices.revoke(device_id)
        for ref in self._gateway.owed(device_id):
            self._gateway.give_up(device_id, ref, "revoked by the operator")
        self._gateway.leave(device_id, "revoked by the operator")
        self._gateway.wake(device_id)  # a held poll ends; the device's next call is refused
        log.warning("device %s revoked", device_id)
        return record

    async def list_refusals(
        self, device_id: str | None = None, job_id: str | None = None, limit: int = 1000
    ) -> list[RefusalRecord]:
        """Refused updates, newest first, as recorded (the last moment's are written first)."""
        await self._refusals.flush()
        return await self._store.list_refusals(device_id, job_id, limit)

    async def submit_job(self, spec_json: str) -> JobRecord:
        return await self._jobs.submit_job(spec_json)

    async def list_jobs(self) -> list[JobRecord]:
        return await self._store.list_jobs()

    async def get_job(self, job_id: str, with_rounds: bool = False) -> JobDetail:
        job = await self._jobs.get(job_id)
        rounds = tuple(await self._store.list_rounds(job.id)) if with_rounds else None
        return JobDetail(job, rounds)

    async def list_rounds(self, job_id: str, after: int = 0) -> list[RoundRecord]:
        """A job's committed rounds numbered above ``after``, oldest first."""
        job = await self._jobs.get(job_id)
        return await self._store.list_rounds(job.id, after)

    async def cancel_job(self, job_id: str) -> JobRecord:
        return await self._jobs.cancel_job(job_id)

    async def export_model(self, job_id: str) -> AsyncGenerator[BlobSlice, None]:
        """The job's latest model, chunk by chunk."""
        job = await self._jobs.get(job_id)
        sent = 0
        try:
            async for piece in self._stream_blob(job.checkpoint_sha256):
                sent += len(piece.data)
                yield piece
        finally:
            self._events.emit(BytesSent("", sent))

    async def list_devices(self, task: str = "", job_id: str = "") -> list[DeviceInfo]:
        """Every enrolled device. With ``task``, those lacking it are ``ineligible``; with
        ``job_id``, those the job may not select now (its task, its ``[eligibility]``), each
        with the reason. Without either, a device no running job of its task may select
        is ``ineligible``, and every device names the running jobs that exclude it."""
        running = self._jobs.policies()
        if job_id:
            task, policy = await self._jobs.policy(job_id)
            return await self._devices.infos(task, policy, running)
        return await self._devices.infos(task, None, running)

    def device_profile(self, device_id: str) -> DeviceProfile | None:
        """The profile selectors see for a device (the pool's, as it last reported it);
        None for a device not seen since this server started."""
        return self._pool.profile(device_id)

    def knob_trials(self) -> list[KnobTrial]:
        """What the ``tuned`` selectors have learned so far, every job's trials (from this
        server's jobs and, after a restart, from those it recalled)."""
        return self._pool.history.all_trials()

    def volunteer_runs(self) -> Sequence[VolunteerRunInfo]:
        return self._hosted.volunteers.infos()

    def device_failures(self) -> Mapping[str, Mapping[str, int]]:
        """Device id -> failure reason -> rounds it failed for that reason, since this
        server started (reasons: ``core.events.FAILURE_REASONS``)."""
        return self._failures.all()

    def device_counts(self) -> Mapping[str, int]:
        """Enrolled devices by state (``idle``, ``busy``, ``offline``), from memory: cheap
        enough for every metrics scrape."""
        counts = Counter({"idle": 0, "busy": 0, "offline": 0})
        for view in self._pool.describe():
            counts[view.state] += 1
        online = counts["idle"] + counts["busy"]
        counts["offline"] = max(self._devices.enrolled - online, counts["offline"])
        return dict(counts)

    # --- blobs ---------------------------------------------------------------------------

    async def _stream_blob(self, sha256: str) -> AsyncGenerator[BlobSlice, None]:
        size = self._blobs.size(sha256)
        offset = 0
        async with self._download_slots:
            for data in self._blobs.iter_chunks(sha256, self._config.download_chunk_bytes):
                first = offset == 0
                yield BlobSlice(
                    data, offset, total_size=size if first else 0, sha256=sha256 if first else ""
                )
                offset += len(data)
        if size == 0:
            raise NotFoundError(f"blob {sha256} is empty")
