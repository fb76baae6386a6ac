"""The Harary graph of SecAgg+: participants shuffled on a ring by a permutation everyone
derives from (job, round), each device masking with k/2 devices on either side."""

from __future__ import annotations

from collections.abc import Mapping

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from flotilla.secagg.config import Session
from flotilla.secagg.keys import frame


def _keystream(session: Session, nbytes: int) -> bytes:
    key = HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=None,
        info=frame(b"flotilla-secagg-ring-v1", session.job_id.encode(), session.round),
    ).derive(b"flotilla-secagg-ring")
    encryptor = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
    return encryptor.update(bytes(nbytes))


def ring(session: Session) -> tuple[str, ...]:
    """The participants (sorted first, so the server's order does not matter) shuffled by
    Fisher-Yates over a ChaCha20 keystream, with rejection sampling (no modulo bias)."""
    order = sorted(session.participants)
    n = len(order)
    # 4 tries per draw on average is far more than rejection needs (< 2); regenerate if out.
    stream = _keystream(session, 8 * 4 * n + 64)
    pos = 0
    for i in range(n - 1, 0, -1):
        bound = i + 1
        limit = (1 << 64) - (1 << 64) % bound
        while True:
            if pos + 8 > len(stream):
                stream = _keystream(session, 2 * len(stream))  # same prefix, longer
            draw = int.from_bytes(stream[pos : pos + 8], "little")
            pos += 8
            if draw < limit:
                break
        j = draw % bound
        order[i], order[j] = order[j], order[i]
    return tuple(order)


def neighbourhoods(session: Session, neighbours: int) -> Mapping[str, frozenset[str]]:
    """Each device's k neighbours: k/2 each side on the ring, or everyone else when
    k >= n - 1 (the config refuses an odd k below n - 1)."""
    order = ring(session)
    n = len(order)
    if neighbours >= n - 1:
        everyone = frozenset(order)
        return {d: everyone - {d} for d in order}
    half = neighbours // 2
    return {
        d: frozenset(order[(p + s) % n] for s in range(-half, half + 1) if s != 0)
        for p, d in enumerate(order)
    }
