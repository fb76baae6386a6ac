"""Secrets: enrolment and operator tokens, device credentials. Only hashes are stored."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from flotilla.core.files import write_private

OPERATOR_TOKEN_FILE = "operator.token"

__all__ = [
    "OPERATOR_TOKEN_FILE",
    "bearer",
    "hash_secret",
    "header",
    "matches",
    "new_secret",
    "write_private",
]


def new_secret() -> str:
    """256 random bits, URL-safe. Never starting with ``-``: a token is passed as a
    command-line value (``--token T``), where a leading dash reads as an option."""
    while (secret := secrets.token_urlsafe(32)).startswith("-"):
        pass
    return secret


def hash_secret(secret: str) -> str:
    """SHA-256 suffices: every secret here is 256 random bits, never a password."""
    return hashlib.sha256(secret.encode()).hexdigest()


def matches(secret: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), stored_hash)


def bearer(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` header, if present."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token:
                return token.strip()
    return None


def header(metadata: tuple[tuple[str, str | bytes], ...] | None, name: str) -> str | None:
    for key, value in metadata or ():
        if key.lower() == name:
            return value.decode() if isinstance(value, bytes) else value
    return None
