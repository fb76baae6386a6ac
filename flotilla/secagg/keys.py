"""Key agreement, derivation, share encryption and the signed statements of SecAgg+.

Everything derived binds the job, the round and both device ids (ordered), so nothing
carries over between rounds, jobs or pairs. Primitives from ``cryptography`` only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

RandBytes = Callable[[int], bytes]
KEY_BYTES = 32
SIGNATURE_BYTES = 64
#: A share key encrypts one message (one direction, one round), so a fixed nonce is safe.
_AEAD_NONCE = bytes(12)


def frame(*parts: bytes | str | int) -> bytes:
    """Length-prefixed concatenation: no two different part lists give the same bytes."""
    out = bytearray()
    for part in parts:
        if isinstance(part, int):
            part = part.to_bytes(8, "big", signed=False)
        elif isinstance(part, str):
            part = part.encode()
        out += len(part).to_bytes(4, "big") + part
    return bytes(out)


@dataclass(frozen=True, slots=True)
class RoundKeys:
    """One device's X25519 key pairs for one round: c for share encryption, s for masks."""

    c_sk: X25519PrivateKey
    s_sk: X25519PrivateKey

    @classmethod
    def generate(cls, randbytes: RandBytes) -> RoundKeys:
        return cls(
            X25519PrivateKey.from_private_bytes(randbytes(KEY_BYTES)),
            X25519PrivateKey.from_private_bytes(randbytes(KEY_BYTES)),
        )

    def public(self) -> tuple[bytes, bytes]:
        return raw_public(self.c_sk.public_key()), raw_public(self.s_sk.public_key())


def raw_public(key: X25519PublicKey) -> bytes:
    return key.public_bytes_raw()


def private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes_raw()


def _hkdf(shared: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)


def _exchange(private: X25519PrivateKey, public: bytes) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as exc:  # a low-order point gives the all-zero secret
        raise ValueError("bad X25519 public key") from exc


def mask_seed(
    s_sk: X25519PrivateKey, peer_s_pk: bytes, job: str, round: int, a: str, b: str
) -> bytes:
    """s_ij: X25519 + HKDF-SHA256, info = job, round and both ids in sorted order."""
    lo, hi = sorted((a, b))
    info = frame(b"flotilla-secagg-mask-v1", job, round, lo, hi)
    return _hkdf(_exchange(s_sk, peer_s_pk), info)


def mask_sign(own: str, peer: str) -> int:
    """+1 for the smaller id of a pair, -1 for the larger: the pair's masks cancel."""
    return 1 if own < peer else -1


def _share_key(
    c_sk: X25519PrivateKey, peer_c_pk: bytes, job: str, round: int, sender: str, receiver: str
) -> bytes:
    info = frame(b"flotilla-secagg-share-v1", job, round, sender, receiver)
    return _hkdf(_exchange(c_sk, peer_c_pk), info)


def share_aad(job: str, round: int, sender: str, receiver: str) -> bytes:
    return frame(b"flotilla-secagg-share-aad-v1", sender, receiver, job, round)


def seal(
    c_sk: X25519PrivateKey,
    peer_c_pk: bytes,
    job: str,
    round: int,
    sender: str,
    receiver: str,
    plaintext: bytes,
) -> bytes:
    """ChaCha20-Poly1305 under a key for this direction of this pair in this round."""
    key = _share_key(c_sk, peer_c_pk, job, round, sender, receiver)
    return ChaCha20Poly1305(key).encrypt(
        _AEAD_NONCE, plaintext, share_aad(job, round, sender, receiver)
    )


def open_sealed(
    c_sk: X25519PrivateKey,
    peer_c_pk: bytes,
    job: str,
    round: int,
    sender: str,
    receiver: str,
    ciphertext: bytes,
) -> bytes | None:
    """The plaintext, or None when the tag, the key or the associated data do not match."""
    try:
        key = _share_key(c_sk, peer_c_pk, job, round, sender, receiver)
        return ChaCha20Poly1305(key).decrypt(
            _AEAD_NONCE, ciphertext, share_aad(job, round, sender, receiver)
        )
    except (InvalidTag, ValueError):
        return None


def advert_statement(job: str, round: int, device: str, c_pk: bytes, s_pk: bytes) -> bytes:
    return frame(b"flotilla-secagg-advertise-v1", job, round, device, c_pk, s_pk)


def survivors_statement(job: str, round: int, survivors: tuple[str, ...]) -> bytes:
    return frame(b"flotilla-secagg-survivors-v1", job, round, len(survivors), *survivors)


def sign(identity: Ed25519PrivateKey, statement: bytes) -> bytes:
    return identity.sign(statement)


def verify(public_key: bytes, signature: bytes, statement: bytes) -> bool:
    """True when ``signature`` is the raw Ed25519 key's over ``statement``."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, statement)
    except (InvalidSignature, ValueError):
        return False
    return True
