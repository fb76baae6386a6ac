"""What a load run asks of the server as its operator, over the HTTP API (docs/http-api.md).

Submit a job file, read a job's committed rounds, cancel it, scrape ``/metrics``: the
same calls an operator's script makes, so a load run needs nothing of the server's code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from flotilla.core.errors import FlotillaError
from flotilla.core.timeouts import Timeouts


@dataclass(frozen=True, slots=True)
class CommittedRound:
    job: str
    round: int
    participants: tuple[str, ...]
    started_at: float
    committed_at: float


class OperatorApi:
    """The HTTP API of the server at ``base_url`` (``http://HOST:PORT``), as its operator."""

    def __init__(self, base_url: str, token: str, timeouts: Timeouts | None = None) -> None:
        self._base = base_url.rstrip("/")
        self._timeout_s = (timeouts or Timeouts()).operator_s
        self._headers = {"Authorization": f"Bearer {token}"}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> OperatorApi:
        timeout = aiohttp.ClientTimeout(total=self._timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout, headers=self._headers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def _call(self, method: str, path: str, data: bytes | None = None) -> bytes:
        assert self._session is not None, "use OperatorApi in 'async with'"
        async with self._session.request(method, self._base + path, data=data) as response:
            body = await response.read()
            if response.status >= 400:
                text = body[:500].decode("utf-8", "replace")
                raise FlotillaError(f"{method} {path}: HTTP {response.status}: {text}")
            return body

    async def submit(self, job_toml: str) -> str:
        """The new job's id."""
        job = json.loads(await self._call("POST", "/api/v1/jobs", job_toml.encode()))
        return str(job["id"])

    async def cancel(self, job_id: str) -> None:
        await self._call("POST", f"/api/v1/jobs/{job_id}/cancel")

    async def job(self, job_id: str) -> dict[str, Any]:
        return dict(json.loads(await self._call("GET", f"/api/v1/jobs/{job_id}")))

    async def rounds(self, job_id: str) -> list[CommittedRound]:
        got = json.loads(await self._call("GET", f"/api/v1/jobs/{job_id}/rounds"))
        return [
            CommittedRound(job_id, int(r["round"]), tuple(r["participants"]),
                           float(r["started_at"]), float(r["committed_at"]))
            for r in got["rounds"]
        ]  # fmt: skip

    async def metrics(self) -> str:
        return (await self._call("GET", "/metrics")).decode()


def gauge(exposition: str, name: str) -> float | None:
    """The value of an unlabelled sample ``name`` in a Prometheus text exposition."""
    for line in exposition.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None
