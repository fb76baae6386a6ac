"""hivemind (libp2p) peer identities, made and read without importing hivemind.

An agent tells the server its peer id before its hivemind peer ever starts, so the server
can name each round's members in its group plan; importing hivemind would cost every agent
a second and 250 MB, though most never average peer to peer. The key file is the one
hivemind writes itself (``P2P.generate_identity``), so a peer started with
``identity_path`` has exactly this id: a libp2p ``PrivateKey`` protobuf around an RSA key in
PKCS#1 DER. The id is the base58 multihash (SHA-256) of the ``PublicKey`` protobuf, as
libp2p's peer-id spec says.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from flotilla.proto.bulk import frame_bytes_field, split_bytes_field

RSA_BITS = 2048
_RSA_TYPE = b"\x08\x00"  # field 1 (key_type) = KeyType.RSA
_DATA = 2  # field 2: the key's bytes
_SHA2_256 = b"\x12\x20"  # multihash code and digest length
_BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def ensure_identity(path: Path) -> str:
    """The peer id of the key at ``path``, creating the key first when there is none."""
    if not path.exists():
        key = rsa.generate_private_key(public_exponent=65537, key_size=RSA_BITS)
        der = key.private_bytes(
            serialization.Encoding.DER,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # owner-only from birth
        with os.fdopen(fd, "wb") as fh:
            fh.write(_key_message(der))
        tmp.replace(path)
    return peer_id(path.read_bytes())


def peer_id(identity: bytes) -> str:
    """Base58 peer id of a libp2p RSA ``PrivateKey`` message; ValueError if it is not one."""
    key = serialization.load_der_private_key(_key_data(identity), password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError("the identity is not an RSA key")
    public = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return _base58(_SHA2_256 + hashlib.sha256(_key_message(public)).digest())


def _key_message(data: bytes) -> bytes:
    """``{key_type: RSA, data}`` as libp2p's proto2 messages encode it (type always written)."""
    return frame_bytes_field(_DATA, data, before=_RSA_TYPE)


def _key_data(message: bytes) -> bytes:
    data, rest = split_bytes_field(message, _DATA)
    if data is None or rest != _RSA_TYPE:
        raise ValueError("the identity is not a libp2p RSA private key")
    return bytes(data)


def _base58(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = ""
    while n:
        n, rem = divmod(n, 58)
        out = _BASE58[rem] + out
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + out
