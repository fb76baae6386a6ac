"""The federation server: storage, the device pool, the gateway and one runner per job."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from flotilla.core.blobs import CHUNK_BYTES
from flotilla.core.blobstore import BlobStore
from flotilla.core.device import DeviceProfile
from flotilla.core.errors import AuthError, FlotillaError, NotFoundError, SpecError, TaskLoadError
from flotilla.core.records import DeviceRecord, JobRecord
from flotilla.core.spec import JobSpec
from flotilla.core.timeouts import Timeouts
from flotilla.engine import (
    EngineConfig,
    EngineServices,
    build_runner,
    job_selector,
    selection_rng,
    submitted_job,
    validate_spec,
)
from flotilla.proto import bulk, handlers
from flotilla.proto import flotilla_pb2 as pb
from flotilla.scheduling import Arbiter, DevicePool, Leases, Selector
from flotilla.server.agent_service import AgentService, profile_from_pb
from flotilla.server.federation import auth
from flotilla.server.federation.budget import ByteBudget
from flotilla.server.federation.gateway import Gateway
from flotilla.server.federation.store import Store, default_url
from flotilla.server.memory import release_free_memory
from flotilla.server.operator_service import OperatorService
from flotilla.server.rendezvous import Rendezvous, require_p2p
from flotilla.server.volunteer_host import VolunteerHost, VolunteerRunSpec
from flotilla.tasks.runtime import LocalTasks

log = logging.getLogger(__name__)

STATE_FILE = "server.json"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    state_dir: Path = Path("flotilla-state")
    db_url: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    engine: EngineConfig = field(default_factory=EngineConfig)
    #: Bytes of update buffers held at once (one update always fits): bounds server memory
    #: to O(model) whatever the fleet size, while small models still upload concurrently.
    upload_budget_bytes: int = 64 * 1024 * 1024
    max_message_bytes: int = 8 * 1024 * 1024
    speed_test_max_bytes: int = 16 * 1024 * 1024
    #: Model downloads streamed at once; the rest wait. Each stream in flight holds
    #: gRPC buffers, so this bounds server memory under a fleet-wide fetch.
    download_slots: int = 2
    download_chunk_bytes: int = CHUNK_BYTES
    #: Volunteer runs to coordinate (the ``p2p`` extra), and where their peers listen.
    volunteer_runs: tuple[VolunteerRunSpec, ...] = ()
    #: Where this server's hivemind peers (volunteer coordinators, the rendezvous of
    #: server-less rounds) listen, and the addresses they announce; loopback by default.
    p2p_host_maddrs: tuple[str, ...] | None = None
    p2p_announce_maddrs: tuple[str, ...] | None = None


class FederationServer:
    """Owns every long-lived part; ``start`` resumes the jobs a previous run left running."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.state_dir = Path(config.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.blobs = BlobStore(self.state_dir / "blobs")
        self.pool = DevicePool(clock=time.time)
        self.leases = Leases(self.pool)
        self.gateway = Gateway(self.pool, time.time, self.leases)
        engine = config.engine
        self.arbiter = Arbiter(self.pool, time.time, engine.selection_grace_s, engine.idle_poll_s)
        self.upload_budget = ByteBudget(config.upload_budget_bytes)
        self.download_slots = asyncio.Semaphore(config.download_slots)
        self.store: Store
        self.port = 0
        self._grpc: grpc.aio.Server | None = None
        self._runners: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._devices: dict[str, DeviceRecord] = {}
        self.volunteers = VolunteerHost(
            config.volunteer_runs, self.state_dir / "volunteer", config.p2p_host_maddrs
        )
        self.rendezvous = Rendezvous(
            self.state_dir / "rendezvous", config.p2p_host_maddrs, config.p2p_announce_maddrs
        )

    @property
    def db_url(self) -> str:
        return self.config.db_url or default_url(self.state_dir)

    async def start(self) -> int:
        self.store = await Store.open(self.db_url)
        await self._ensure_operator_token()
        self._grpc = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self.config.max_message_bytes),
                ("grpc.max_send_message_length", self.config.max_message_bytes),
                ("grpc.so_reuseport", 0),
                # Notice dead peers on idle connections instead of holding their calls open.
                ("grpc.keepalive_time_ms", 30_000),
                ("grpc.keepalive_timeout_ms", 10_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ]
        )
        agent_codecs = {
            "FetchModel": handlers.PRESERIALIZED,
            "SubmitUpdate": handlers.Codecs(request_deserializer=bulk.read_update_chunk),
        }
        handlers.register(self._grpc, "Agent", AgentService(self), agent_codecs)
        handlers.register(
            self._grpc, "Operator", OperatorService(self), {"ExportModel": handlers.PRESERIALIZED}
        )
        address = f"{self.config.host}:{self.config.port}"
        if self.config.tls_cert and self.config.tls_key:
            creds = grpc.ssl_server_credentials(
                [(self.config.tls_key.read_bytes(), self.config.tls_cert.read_bytes())]
            )
            self.port = self._grpc.add_secure_port(address, creds)
        else:
            self.port = self._grpc.add_insecure_port(address)
        await self._grpc.start()
        state = {"host": self.config.host, "port": self.port, "db_url": self.db_url}
        (self.state_dir / STATE_FILE).write_text(json.dumps(state))
        self._spawn(self._reaper())
        for job in await self.store.jobs_to_resume():
            self._start_runner(job)
        await self.volunteers.start()
        log.info("listening on %s:%d", self.config.host, self.port)
        return self.port

    async def stop(self, grace_s: float = 1.0) -> None:
        for task in [*self._runners.values(), *self._background]:
            task.cancel()
        for task in [*self._runners.values(), *self._background]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.arbiter.close()
        await self.volunteers.stop()
        await self.rendezvous.stop()
        if self._grpc is not None:
            await self._grpc.stop(grace_s)
        await self.store.close()

    async def wait(self) -> None:
        assert self._grpc is not None
        await self._grpc.wait_for_termination()

    def _spawn(self, coro: object) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _ensure_operator_token(self) -> None:
        path = self.state_dir / auth.OPERATOR_TOKEN_FILE
        if path.exists():
            token = path.read_text().strip()
            if await self.store.has_operator_token(auth.hash_secret(token)):
                return
        token = auth.new_secret()
        await self.store.add_operator_token(auth.hash_secret(token))
        auth.write_private(path, token + "\n")

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.config.timeouts.liveness / 4))
            for device_id in self.gateway.reap(self.config.timeouts.liveness):
                log.info("device %s went silent", device_id)
            release_free_memory()

    # --- devices -------------------------------------------------------------------------

    async def enrol(self, token: str, profile: pb.DeviceProfile) -> tuple[str, str]:
        if not token or not await self.store.has_enrol_token(auth.hash_secret(token)):
            raise AuthError("enrolment token refused")
        device_id = "dev-" + uuid.uuid4().hex[:12]
        credential = auth.new_secret()
        now = time.time()
        record = DeviceRecord(
            id=device_id,
            credential_hash=auth.hash_secret(credential),
            tasks=tuple(profile.tasks),
            profile=profile_from_pb(device_id, profile).numbers(),
            enrolled_at=now,
            last_seen_at=now,
        )
        await self.store.add_device(record)
        self._devices[device_id] = record
        return device_id, credential

    async def authenticate_device(
        self, metadata: Sequence[tuple[str, str | bytes]] | None
    ) -> DeviceRecord:
        md = tuple(metadata or ())
        device_id, secret = auth.header(md, "x-flotilla-device"), auth.bearer(md)
        if not device_id or not secret:
            raise AuthError("missing device credentials")
        record = self._devices.get(device_id)
        if record is None:
            record = await self.store.get_device(device_id)
            if record is not None:
                self._devices[device_id] = record
        if record is None or not auth.matches(secret, record.credential_hash):
            raise AuthError("device credentials refused")
        return record

    async def authenticate_operator(
        self, metadata: Sequence[tuple[str, str | bytes]] | None
    ) -> None:
        token = auth.bearer(tuple(metadata or ()))
        if not token or not await self.store.has_operator_token(auth.hash_secret(token)):
            raise AuthError("operator token refused")

    async def device_seen(self, device: DeviceRecord, profile: pb.DeviceProfile | None) -> None:
        if profile is not None:
            numbers = profile_from_pb(device.id, profile).numbers()
            await self.store.update_device(device.id, profile=numbers, tasks=tuple(profile.tasks))
            device = self._devices[device.id] = await self.store.get_device(device.id) or device
        self.pool.seen(
            DeviceProfile(
                device_id=device.id,
                tasks=device.tasks,
                gflops=device.profile.get("gflops", 0.0),
                memory_bytes=int(device.profile.get("memory_bytes", 0)),
                upload_bytes_per_s=device.profile.get("upload_bytes_per_s", 0.0),
            )
        )

    async def device_infos(self, task: str = "") -> list[pb.DeviceInfo]:
        """Every enrolled device: the pool's view of those seen since start, the rest offline."""
        views = {v.device_id: v for v in self.pool.describe(task)}
        history = self.pool.history
        out = []
        for record in await self.store.list_devices():
            view = views.get(record.id)
            selected = {
                job: rec.selected
                for job, devices in history.records.items()
                if (rec := devices.get(record.id)) is not None
            }
            out.append(
                pb.DeviceInfo(
                    id=record.id,
                    state=view.state if view else "offline",
                    job_id=view.job_id if view else "",
                    reason=view.reason if view else "",
                    tasks=list(record.tasks),
                    gflops=record.profile.get("gflops", 0.0),
                    upload_bytes_per_s=record.profile.get("upload_bytes_per_s", 0.0),
                    last_seen=view.last_seen if view else 0.0,
                    selected=selected,
                )
            )
        return out

    # --- jobs ----------------------------------------------------------------------------

    def _selector(self, spec: JobSpec) -> Selector:
        """Selection seeded from ``job.seed`` (core/spec.py), as the simulator seeds it."""
        return job_selector(spec, self.pool, selection_rng(spec.job.seed))

    async def submit_job(self, spec_json: str) -> JobRecord:
        spec = JobSpec.from_json(spec_json, "submitted spec")
        validate_spec(spec)
        if spec.aggregation.transport == "p2p":
            require_p2p()
        self._selector(spec)  # e.g. an rl policy_file that is missing: refused now
        job_id = "job-" + uuid.uuid4().hex[:10]
        try:
            job, size = await asyncio.to_thread(
                submitted_job, job_id, spec, self.blobs, LocalTasks(), time.time()
            )
        except TaskLoadError as exc:
            raise SpecError(f"job.task: {exc}") from exc
        await self.store.add_checkpoint(job.checkpoint_sha256, size)
        await self.store.add_job(job)
        self._start_runner(job)
        return job

    async def cancel_job(self, job_id: str) -> JobRecord:
        runner = self._runners.pop(job_id, None)
        if runner is not None:
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await runner
        return await self.store.set_job_state(job_id, "cancelled")

    def _start_runner(self, job: JobRecord) -> None:
        task = asyncio.ensure_future(self._run_job(job))
        self._runners[job.id] = task

    async def _run_job(self, job: JobRecord) -> None:
        job_id = job.id
        try:
            spec = JobSpec.from_json(job.spec_json, f"job {job.id}")
            # Importing a task (torch, data) takes seconds: keep it off the event loop.
            evaluator = await asyncio.to_thread(LocalTasks().evaluator, spec)
            services = EngineServices(
                backend=self.gateway,
                leases=self.leases,
                arbiter=self.arbiter,
                ledger=self.store,
                blobs=self.blobs,
                clock=time.time,
                config=self.config.engine,
                p2p=self.rendezvous,
            )
            rng = selection_rng(spec.job.seed)
            spool = self.state_dir / "spool" / job.id
            await build_runner(job, spec, services, rng, evaluator, spool).run()
        except asyncio.CancelledError:
            raise
        except FlotillaError as exc:
            log.error("job %s stopped: %s", job_id, exc)
            with contextlib.suppress(Exception):
                current = await self.store.get_job(job_id)
                if current is not None and not current.terminal:
                    await self.store.set_job_state(job_id, "failed")
        except Exception:
            log.exception("job %s failed", job_id)
            with contextlib.suppress(Exception):
                await self.store.set_job_state(job_id, "failed")
        finally:
            self._runners.pop(job_id, None)

    # --- blobs ---------------------------------------------------------------------------

    async def stream_blob(self, sha256: str) -> AsyncIterator[tuple[bytes, int]]:
        """(serialized ``BlobChunk``, payload bytes in it) for each chunk of a blob."""
        size = self.blobs.size(sha256)
        offset = 0
        async with self.download_slots:
            for data in self.blobs.iter_chunks(sha256, self.config.download_chunk_bytes):
                first = offset == 0
                message = bulk.blob_chunk(
                    data, offset, total_size=size if first else 0, sha256=sha256 if first else ""
                )
                yield message, len(data)
                offset += len(data)
        if size == 0:
            raise NotFoundError(f"blob {sha256} is empty")
