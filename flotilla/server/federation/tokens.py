"""Minting tokens from the command line, straight into the server's database: enrolment
tokens (a device joins with one) and read tokens (the HTTP API's read routes, the
dashboard). Neither does the other's job."""

from __future__ import annotations

import json
from pathlib import Path

from flotilla.server.federation import auth
from flotilla.server.federation.store import Store, default_url


async def create_enrol_token(state_dir: Path, db_url: str | None = None) -> str:
    """A new enrolment token; only its hash is stored. The server need not be running."""
    return await _mint(state_dir, db_url, read_only=False)


async def create_read_token(state_dir: Path, db_url: str | None = None) -> str:
    """A new read-only token of the operator APIs (the HTTP API's read routes and
    ``/metrics``); only its hash is stored, with its scope."""
    return await _mint(state_dir, db_url, read_only=True)


async def _mint(state_dir: Path, db_url: str | None, read_only: bool) -> str:
    if db_url is None:
        state_file = Path(state_dir) / "server.json"
        if state_file.exists():
            db_url = json.loads(state_file.read_text()).get("db_url")
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    store = await Store.open(db_url or default_url(Path(state_dir)))
    try:
        token = auth.new_secret()
        if read_only:
            await store.add_operator_token(auth.hash_secret(token), scope="read")
        else:
            await store.add_enrol_token(auth.hash_secret(token))
    finally:
        await store.close()
    return token
