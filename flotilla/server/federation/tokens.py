"""Minting enrolment tokens from the command line, straight into the server's database."""

from __future__ import annotations

import json
from pathlib import Path

from flotilla.server.federation import auth
from flotilla.server.federation.store import Store, default_url


async def create_enrol_token(state_dir: Path, db_url: str | None = None) -> str:
    """A new enrolment token; only its hash is stored. The server need not be running."""
    if db_url is None:
        state_file = Path(state_dir) / "server.json"
        if state_file.exists():
            db_url = json.loads(state_file.read_text()).get("db_url")
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    store = await Store.open(db_url or default_url(Path(state_dir)))
    try:
        token = auth.new_secret()
        await store.add_enrol_token(auth.hash_secret(token))
    finally:
        await store.close()
    return token
