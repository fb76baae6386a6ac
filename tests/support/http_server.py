"""A real :class:`FederationServer` with its HTTP edge on a free port of 127.0.0.1, in the
test's event loop, with real agents (``LocalTrainer`` over the digits task) joining through
the in-process transport, and an aiohttp client to call the API with each kind of token.
Shared by the test_http_*.py and test_live_feed.py tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from flotilla.engine import EngineConfig
from flotilla.server.app import FederationServer, ServerConfig
from flotilla.server.federation import auth
from flotilla.server.federation.store import Store
from flotilla.server.federation.tokens import create_read_token
from tests.support.inproc import SERVER_TIMEOUTS, InProcessFederation

HTTP_TIMEOUT = aiohttp.ClientTimeout(total=30)


@dataclass
class HttpServer:
    server: FederationServer
    fleet: InProcessFederation
    http: aiohttp.ClientSession
    base: str
    operator_token: str
    read_token: str

    def headers(self, token: str | None) -> dict[str, str]:
        return {} if token is None else {"Authorization": f"Bearer {token}"}

    async def call(
        self, method: str, path: str, token: str | None = "operator", **kwargs: Any
    ) -> tuple[int, Any]:
        """``(status, body)``: JSON when the answer is JSON, else the bytes. ``token`` is
        ``"operator"``, ``"read"``, None (no header) or a literal token."""
        literal = {"operator": self.operator_token, "read": self.read_token}.get(token or "", token)
        async with self.http.request(
            method, self.base + path, headers=self.headers(literal), **kwargs
        ) as r:
            if r.content_type == "application/json":
                return r.status, await r.json()
            return r.status, await r.read()

    async def get(self, path: str, token: str | None = "read") -> Any:
        status, body = await self.call("GET", path, token)
        assert status == 200, (path, status, body)
        return body

    async def submit_toml(self, toml: str, token: str = "operator") -> tuple[int, Any]:
        return await self.call("POST", "/api/v1/jobs", token, data=toml.encode())


def quick_toml(name: str = "quick", rounds: int = 3, clients: int = 2) -> str:
    """A digits job (every other field at its default) that ends in seconds."""
    return (
        "[job]\n"
        f'name = "{name}"\n'
        'task = "flotilla.tasks.digits:DigitsTask"\n'
        f"rounds = {rounds}\n"
        f"clients_per_round = {clients}\n"
        f"min_quorum = {clients}\n"
        "round_deadline_s = 60.0\n"
    )


async def wait_until(done: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await done():
        assert time.monotonic() < deadline, f"{what} not within {timeout}s"
        await asyncio.sleep(0.1)


@asynccontextmanager
async def http_server(state_dir: Path, db_url: str, **config: Any) -> AsyncIterator[HttpServer]:
    """Start the server (HTTP on a free port), a client, and tokens of both kinds."""
    if db_url.startswith("postgresql"):  # a shared database: start empty
        store = await Store.open(db_url)
        try:
            await store.wipe()
        finally:
            await store.close()
    config.setdefault("timeouts", SERVER_TIMEOUTS)
    config.setdefault("engine", EngineConfig(selection_grace_s=0.2))
    server = FederationServer(
        ServerConfig(host="127.0.0.1", port=0, state_dir=state_dir, db_url=db_url, http_port=0,
                     **config)
    )  # fmt: skip
    await server.start()
    fleet = InProcessFederation(server.federation, server.store, state_dir, db_url)
    read_token = await create_read_token(state_dir, db_url)
    operator_token = (state_dir / auth.OPERATOR_TOKEN_FILE).read_text().strip()
    http = aiohttp.ClientSession(timeout=HTTP_TIMEOUT)
    try:
        yield HttpServer(
            server, fleet, http, f"http://127.0.0.1:{server.http_port}", operator_token,
            read_token,
        )  # fmt: skip
    finally:
        await http.close()
        await fleet.stop_agents()
        await server.stop(grace_s=0.2)
