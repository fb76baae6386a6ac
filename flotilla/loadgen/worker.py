"""A load worker process: many :class:`LoadDevice` loops on one event loop.

``python -m flotilla.loadgen.worker`` reads a :class:`WorkerPlan` as JSON on stdin (it
holds an enrolment token: never on a command line, where ``ps`` shows it), runs the devices
it asks for until its duration is over, and prints one JSON :class:`WorkerReport` on
stdout. The kernel ends it if the runner that started it dies, however that dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from flotilla.client.transport import AgentTransport
from flotilla.core.lifetime import end_with_parent
from flotilla.loadgen.device import Accepted, CannedUpdate, DeviceScript, LoadDevice, Tally
from flotilla.loadgen.latency import LatencyHistogram

#: gRPC devices share a channel per this many (HTTP/2 streams multiplex on it).
DEVICES_PER_CHANNEL = 50
#: Seconds a device may take to finish its round and leave after the run ends.
WIND_DOWN_S = 30.0


@dataclass(frozen=True, slots=True)
class WorkerPlan:
    edge: str  # "grpc" (HOST:PORT) or "http" (http://HOST:PORT)
    server: str
    token: str
    task: str
    devices: int
    duration_s: float
    poll_every_s: float
    #: Devices start spread over this many seconds, not as one thundering herd.
    ramp_s: float
    seed: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerPlan:
        return cls(**json.loads(text))


@dataclass(frozen=True, slots=True)
class WorkerReport:
    devices: int
    enrolled: int
    latencies: dict[str, LatencyHistogram]
    accepted: tuple[Accepted, ...]
    not_accepted: int
    errors: dict[str, int]
    #: Devices still running when the wind-down time ran out (cancelled).
    stuck: int

    def to_json(self) -> dict[str, Any]:
        return {
            "devices": self.devices,
            "enrolled": self.enrolled,
            "latencies": {k: h.to_json() for k, h in self.latencies.items()},
            "accepted": [[a.job, a.round, a.device] for a in self.accepted],
            "not_accepted": self.not_accepted,
            "errors": self.errors,
            "stuck": self.stuck,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkerReport:
        return cls(
            devices=int(data["devices"]),
            enrolled=int(data["enrolled"]),
            latencies={k: LatencyHistogram.from_json(v) for k, v in data["latencies"].items()},
            accepted=tuple(Accepted(str(j), int(r), str(d)) for j, r, d in data["accepted"]),
            not_accepted=int(data["not_accepted"]),
            errors={str(k): int(v) for k, v in data["errors"].items()},
            stuck=int(data["stuck"]),
        )


async def run_worker(plan: WorkerPlan) -> WorkerReport:
    tally = Tally()
    update = CannedUpdate(plan.seed)
    script = DeviceScript(plan.token, plan.task, plan.poll_every_s)
    stop = asyncio.Event()
    async with _transports(plan) as transports:
        rng = random.Random(plan.seed)
        devices = [
            LoadDevice(transports[i % len(transports)], script, update, tally,
                       random.Random(rng.getrandbits(64)))
            for i in range(plan.devices)
        ]  # fmt: skip

        async def start(i: int, device: LoadDevice) -> None:
            await asyncio.sleep(plan.ramp_s * i / max(1, plan.devices))
            await device.run(stop)

        tasks = [asyncio.ensure_future(start(i, d)) for i, d in enumerate(devices)]
        await asyncio.sleep(plan.duration_s)
        stop.set()
        _, stuck = await asyncio.wait(tasks, timeout=WIND_DOWN_S)
        for task in stuck:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return WorkerReport(
        devices=plan.devices,
        enrolled=tally.enrolled,
        latencies=tally.latencies,
        accepted=tuple(tally.accepted),
        not_accepted=tally.not_accepted,
        errors=tally.errors,
        stuck=len(stuck),
    )


@contextlib.asynccontextmanager
async def _transports(plan: WorkerPlan) -> Any:
    if plan.edge == "http":
        import aiohttp

        from flotilla.loadgen.http_transport import HttpTransport

        connector = aiohttp.TCPConnector(limit=plan.devices, force_close=False)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=60.0)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            yield [HttpTransport(plan.server, session)]
        return
    from flotilla.client.grpc_transport import GrpcTransport

    channels = max(1, -(-plan.devices // DEVICES_PER_CHANNEL))
    grpc_transports: list[AgentTransport] = [GrpcTransport(plan.server) for _ in range(channels)]
    try:
        yield grpc_transports
    finally:
        for t in grpc_transports:
            await t.aclose()


def main() -> int:
    end_with_parent()
    plan = WorkerPlan.from_json(sys.stdin.read())
    started = time.perf_counter()
    report = asyncio.run(run_worker(plan))
    out = report.to_json()
    out["seconds"] = time.perf_counter() - started
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
