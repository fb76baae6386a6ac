"""Minting, listing and revoking tokens from the command line, straight into the server's
database (the server need not be running; a running one sees the change at the next
enrolment): enrolment tokens (a device joins with one, within its uses and expiry) and read
tokens (the HTTP API's read routes, the dashboard). Neither does the other's job."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from flotilla.core.errors import SpecError
from flotilla.core.records import EnrolTokenRecord
from flotilla.server.federation import auth
from flotilla.server.federation.store import Store, default_url

__all__ = [
    "MintedToken",
    "create_enrol_token",
    "create_read_token",
    "list_enrol_tokens",
    "parse_duration",
    "revoke_enrol_token",
]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
#: Longer than any token should live: a typo like ``--expires 30000d`` is refused.
MAX_DURATION_S = 10 * 365 * 86400


@dataclass(frozen=True, slots=True)
class MintedToken:
    """A new token, the one time it is seen in clear, and the id it is listed under."""

    token: str
    id: str
    uses: int | None = None
    expires_at: float | None = None


def parse_duration(text: str) -> float:
    """Seconds in ``30s``, ``30m``, ``24h`` or ``7d`` (a whole positive number and a unit)."""
    found = re.fullmatch(r"\s*(\d{1,9})\s*([smhd])\s*", text)
    if found is None or int(found[1]) == 0:
        raise SpecError(
            f"--expires: a duration is a whole positive number and a unit s, m, h or d "
            f"(30m, 24h, 7d), got {text!r}"
        )
    seconds = int(found[1]) * _UNITS[found[2]]
    if seconds > MAX_DURATION_S:
        raise SpecError(f"--expires: {text!r} is longer than ten years")
    return float(seconds)


async def create_enrol_token(
    state_dir: Path,
    db_url: str | None = None,
    uses: int | None = None,
    expires_s: float | None = None,
) -> MintedToken:
    """A new enrolment token admitting ``uses`` enrolments (None: unlimited) for
    ``expires_s`` seconds (None: forever); only its hash is stored."""
    if uses is not None and uses < 1:
        raise SpecError(f"--uses: a token admits at least 1 enrolment, got {uses}")
    expires_at = None if expires_s is None else time.time() + expires_s
    store = await _open(state_dir, db_url)
    try:
        token = auth.new_secret()
        token_id = await store.add_enrol_token(auth.hash_secret(token), uses, expires_at)
    finally:
        await store.close()
    return MintedToken(token, token_id, uses, expires_at)


async def create_read_token(state_dir: Path, db_url: str | None = None) -> str:
    """A new read-only token of the operator APIs (the HTTP API's read routes and
    ``/metrics``); only its hash is stored, with its scope."""
    store = await _open(state_dir, db_url)
    try:
        token = auth.new_secret()
        await store.add_operator_token(auth.hash_secret(token), scope="read")
    finally:
        await store.close()
    return token


async def list_enrol_tokens(state_dir: Path, db_url: str | None = None) -> list[EnrolTokenRecord]:
    store = await _open(state_dir, db_url)
    try:
        return await store.list_enrol_tokens(time.time())
    finally:
        await store.close()


async def revoke_enrol_token(
    state_dir: Path, token_id: str, db_url: str | None = None
) -> EnrolTokenRecord:
    """Revoke at once: the next enrolment with it is refused ``revoked``; devices that
    enrolled with it keep their own credentials."""
    store = await _open(state_dir, db_url)
    try:
        return await store.revoke_enrol_token(token_id, time.time())
    finally:
        await store.close()


async def _open(state_dir: Path, db_url: str | None) -> Store:
    if db_url is None:
        state_file = Path(state_dir) / "server.json"
        if state_file.exists():
            db_url = json.loads(state_file.read_text()).get("db_url")
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    return await Store.open(db_url or default_url(Path(state_dir)))
