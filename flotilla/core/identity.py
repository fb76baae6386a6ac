"""A device's identity: an Ed25519 key it makes at enrolment, and what it signs with it.

The one definition of the signed statement of an update lives here, so the gRPC agent,
the lite client and the server cannot drift apart. The statement binds an update to one
device (its key), one job, one attempt at one round (job, round, round token), its exact
bytes (their SHA-256) and one upload (a fresh random nonce)::

    "flotilla/update/v1" 0x00
    then, for each of job_id (UTF-8), round (8 bytes, big-endian), round_token (UTF-8),
    payload_sha256 (32 bytes), nonce (16 bytes): its length (4 bytes, big-endian), its bytes

Length prefixes make the encoding injective (no two field tuples give the same bytes);
the domain tag with its version keeps a signature made here from meaning anything in any
other protocol, and lets a later statement change shape without ambiguity.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from flotilla.core.errors import WireError
from flotilla.core.files import write_private_atomic

log = logging.getLogger(__name__)

#: The file a device keeps its private key in, inside its state dir (mode 0600).
KEY_FILE = "device.key"
#: Random bytes per upload: never reused, so a captured upload cannot be sent twice.
NONCE_BYTES = 16
SIGNATURE_BYTES = 64
PUBLIC_KEY_HEX = 64
#: Domain tag and version of the statement: first bytes of everything an update signs.
STATEMENT_TAG = b"flotilla/update/v1\x00"
#: The longest job id or round token a statement takes (the store's id columns hold 128).
MAX_FIELD = 1024
_HEX = frozenset("0123456789abcdef")


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def update_statement(
    job_id: str, round: int, round_token: str, payload_sha256: bytes, nonce: bytes
) -> bytes:
    """The bytes a device signs for one upload (the module docstring draws them)."""
    job, token = job_id.encode(), round_token.encode()
    if len(job) > MAX_FIELD or len(token) > MAX_FIELD:
        raise WireError(f"job id and round token are at most {MAX_FIELD} bytes")
    if not 0 <= round < 2**63:
        raise WireError(f"round {round} is out of range")
    if len(payload_sha256) != 32:
        raise WireError("payload_sha256 must be the 32-byte digest")
    if len(nonce) != NONCE_BYTES:
        raise WireError(f"the nonce must be {NONCE_BYTES} bytes")
    return STATEMENT_TAG + b"".join(
        _field(f) for f in (job, round.to_bytes(8, "big"), token, payload_sha256, nonce)
    )


def digest_bytes(sha256_hex: str) -> bytes:
    """The 32 bytes of a SHA-256 written as 64 lowercase hex digits (WireError otherwise)."""
    if len(sha256_hex) != 64 or not set(sha256_hex) <= _HEX:
        raise WireError("payload_sha256 must be 64 lowercase hex digits")
    return bytes.fromhex(sha256_hex)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def public_key(public_key_hex: str) -> Ed25519PublicKey:
    """A registered public key, checked: 64 lowercase hex digits of a valid Ed25519 key."""
    if len(public_key_hex) != PUBLIC_KEY_HEX or not set(public_key_hex) <= _HEX:
        raise WireError(f"a public key is {PUBLIC_KEY_HEX} lowercase hex digits (Ed25519)")
    try:
        return Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key_hex))
    except ValueError as exc:
        raise WireError(f"not an Ed25519 public key: {exc}") from None


def verify_update(public_key_hex: str, statement: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is the key's signature of ``statement``."""
    if len(signature) != SIGNATURE_BYTES:
        return False
    try:
        public_key(public_key_hex).verify(signature, statement)
    except (InvalidSignature, WireError):
        return False
    return True


@dataclass(frozen=True, slots=True)
class UpdateSignature:
    """What travels with an update besides its header: the nonce and the signature."""

    nonce: bytes
    signature: bytes


class DeviceIdentity:
    """A device's Ed25519 key pair. The private key never leaves the device's state dir."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key

    @classmethod
    def generate(cls) -> DeviceIdentity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: Path) -> DeviceIdentity | None:
        """The key saved at ``path``; None when there is none. A key file others may read
        is made owner-only again (and said so): the key itself may have leaked."""
        try:
            mode = path.stat().st_mode
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("key file %s was readable by others; made it owner-only", path)
            os.chmod(path, 0o600)
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except ValueError as exc:
            raise WireError(f"{path} is not a PEM private key: {exc}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise WireError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
        return cls(key)

    def save(self, path: Path) -> None:
        """Write the private key (PKCS#8 PEM), readable by its owner only from birth."""
        pem = self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        write_private_atomic(path, pem)

    @property
    def public_key_hex(self) -> str:
        raw = self._key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        return raw.hex()

    @property
    def key(self) -> Ed25519PrivateKey:
        """The private key itself, for protocols that sign with the device's registered
        identity (SecAgg+ key advertisements and survivor lists); it never leaves the device."""
        return self._key

    def sign(self, statement: bytes) -> bytes:
        return self._key.sign(statement)

    def sign_update(
        self,
        job_id: str,
        round: int,
        round_token: str,
        payload_sha256: bytes,
        nonce: bytes | None = None,
    ) -> UpdateSignature:
        """Sign one upload; a fresh nonce unless one is given (tests replaying uploads)."""
        used = new_nonce() if nonce is None else nonce
        statement = update_statement(job_id, round, round_token, payload_sha256, used)
        return UpdateSignature(used, self.sign(statement))
