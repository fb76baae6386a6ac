"""Every SecAgg+ message as strict, versioned, bounded bytes (no pickle, no JSON).

Each message starts ``b"FSA"``, a version byte and a kind byte; then fixed fields, and for
lists a u16 count checked against the bytes left before anything is allocated. Ids are
UTF-8, 1 to 128 bytes, u8-prefixed. Trailing bytes are refused. Decoders raise
:class:`SecAggMessageError` and nothing else."""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np

from flotilla.secagg import bits
from flotilla.secagg.config import MAX_DEVICES, MAX_LENGTH
from flotilla.secagg.errors import SecAggMessageError
from flotilla.secagg.keys import KEY_BYTES, SIGNATURE_BYTES
from flotilla.secagg.shamir import ELEMENT_BYTES, PRIME, Share

MAGIC = b"FSA"
VERSION = 1
#: Every message but a masked input fits in this (10,000 entries of a few hundred bytes).
MAX_CONTROL_BYTES = 4 << 20
MAX_ID_BYTES = 128
#: A sealed share bundle: 2 shares (u16 + 66 bytes each) and a 16-byte tag, with room.
MAX_SEALED_BYTES = 256
_HEADER = len(MAGIC) + 2


class Kind(enum.IntEnum):
    ADVERTISE = 1
    ADVERT_LIST = 2
    SHARES = 3
    SHARE_LIST = 4
    MASKED_INPUT = 5
    SURVIVORS = 6
    CONSISTENCY = 7
    SIGNATURES = 8
    UNMASK = 9
    SHARE_BUNDLE = 10


class Secret(enum.IntEnum):
    """Which secret a revealed share belongs to."""

    SELF_MASK = 1  # b_j: the owner survived
    MASK_KEY = 2  # s_sk_j: the owner dropped


@dataclass(frozen=True, slots=True)
class Advertisement:
    c_pk: bytes
    s_pk: bytes
    signature: bytes


@dataclass(frozen=True, slots=True)
class AdvertEntry:
    """A neighbour's advertisement as the server forwards it, with its identity key."""

    device_id: str
    identity_key: bytes
    c_pk: bytes
    s_pk: bytes
    signature: bytes


@dataclass(frozen=True, slots=True)
class Sealed:
    """An encrypted share bundle; ``peer`` is the receiver going up, the sender coming down."""

    peer: str
    ciphertext: bytes


@dataclass(frozen=True, slots=True)
class SurvivorList:
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Reveal:
    owner: str
    secret: Secret
    share: Share


@dataclass(frozen=True, slots=True)
class ShareBundle:
    self_mask: Share
    mask_key: Share


class _Reader:
    def __init__(self, data: bytes | bytearray | memoryview, kind: Kind, limit: int) -> None:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise SecAggMessageError("malformed", "not bytes")
        if len(data) > limit:
            raise SecAggMessageError("oversized", f"{len(data)} bytes > {limit}")
        self.data = memoryview(data).cast("B") if isinstance(data, memoryview) else data
        self.pos = 0
        if bytes(self.raw(len(MAGIC))) != MAGIC:
            raise SecAggMessageError("malformed", "not a SecAgg message")
        if self.u8() != VERSION:
            raise SecAggMessageError("wrong version", f"expected {VERSION}")
        if self.u8() != kind:
            raise SecAggMessageError("malformed", f"not a {kind.name} message")

    def raw(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise SecAggMessageError("malformed", "truncated")
        out = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return out

    def u8(self) -> int:
        return self.raw(1)[0]

    def u16(self) -> int:
        return int(struct.unpack(">H", self.raw(2))[0])

    def u32(self) -> int:
        return int(struct.unpack(">I", self.raw(4))[0])

    def text(self) -> str:
        n = self.u8()
        if not 1 <= n <= MAX_ID_BYTES:
            raise SecAggMessageError("malformed", "bad id length")
        try:
            return self.raw(n).decode("utf-8")
        except UnicodeDecodeError:
            raise SecAggMessageError("malformed", "id is not UTF-8") from None

    def count(self, smallest_entry: int) -> int:
        n = self.u16()
        if n > MAX_DEVICES or n * smallest_entry > len(self.data) - self.pos:
            raise SecAggMessageError("malformed", "bad entry count")
        return n

    def share(self) -> Share:
        x = self.u16()
        y = int.from_bytes(self.raw(ELEMENT_BYTES), "big")
        if x == 0 or y >= PRIME:
            raise SecAggMessageError("malformed", "share outside the field")
        return Share(x, y)

    def end(self) -> None:
        if self.pos != len(self.data):
            raise SecAggMessageError("malformed", "trailing bytes")


def _header(kind: Kind) -> bytearray:
    return bytearray(MAGIC + bytes([VERSION, kind]))


def _text(value: str) -> bytes:
    raw = value.encode()
    if not 1 <= len(raw) <= MAX_ID_BYTES:
        raise ValueError("a device id is 1 to 128 bytes")
    return bytes([len(raw)]) + raw


def _unique(ids: list[str]) -> None:
    if len(set(ids)) != len(ids):
        raise SecAggMessageError("malformed", "repeated device id")


def _share(share: Share) -> bytes:
    return struct.pack(">H", share.x) + share.y.to_bytes(ELEMENT_BYTES, "big")


def encode_advertisement(msg: Advertisement) -> bytes:
    return bytes(_header(Kind.ADVERTISE) + msg.c_pk + msg.s_pk + msg.signature)


def decode_advertisement(data: bytes) -> Advertisement:
    r = _Reader(data, Kind.ADVERTISE, MAX_CONTROL_BYTES)
    out = Advertisement(r.raw(KEY_BYTES), r.raw(KEY_BYTES), r.raw(SIGNATURE_BYTES))
    r.end()
    return out


def encode_advert_list(entries: tuple[AdvertEntry, ...]) -> bytes:
    out = _header(Kind.ADVERT_LIST) + struct.pack(">H", len(entries))
    for e in entries:
        out += _text(e.device_id) + e.identity_key + e.c_pk + e.s_pk + e.signature
    return bytes(out)


def decode_advert_list(data: bytes) -> tuple[AdvertEntry, ...]:
    r = _Reader(data, Kind.ADVERT_LIST, MAX_CONTROL_BYTES)
    entries = []
    for _ in range(r.count(2 + 3 * KEY_BYTES + SIGNATURE_BYTES)):
        entries.append(
            AdvertEntry(
                r.text(),
                r.raw(KEY_BYTES),
                r.raw(KEY_BYTES),
                r.raw(KEY_BYTES),
                r.raw(SIGNATURE_BYTES),
            )
        )
    r.end()
    _unique([e.device_id for e in entries])
    return tuple(entries)


def encode_sealed(kind: Kind, entries: tuple[Sealed, ...]) -> bytes:
    """``Kind.SHARES`` (device -> server) or ``Kind.SHARE_LIST`` (server -> device)."""
    out = _header(kind) + struct.pack(">H", len(entries))
    for e in entries:
        out += _text(e.peer) + struct.pack(">H", len(e.ciphertext)) + e.ciphertext
    return bytes(out)


def decode_sealed(data: bytes, kind: Kind) -> tuple[Sealed, ...]:
    if kind not in (Kind.SHARES, Kind.SHARE_LIST):
        raise ValueError("sealed lists are SHARES or SHARE_LIST")
    r = _Reader(data, kind, MAX_CONTROL_BYTES)
    entries = []
    for _ in range(r.count(4)):
        peer = r.text()
        n = r.u16()
        if n > MAX_SEALED_BYTES:
            raise SecAggMessageError("oversized", "sealed share too long")
        entries.append(Sealed(peer, r.raw(n)))
    r.end()
    _unique([e.peer for e in entries])
    return tuple(entries)


def masked_input_size(count: int, modulus_bits: int) -> int:
    return _HEADER + 5 + bits.packed_size(count, modulus_bits)


def encode_masked_input(values: np.ndarray, modulus_bits: int) -> bytes:
    head = _header(Kind.MASKED_INPUT) + bytes([modulus_bits]) + struct.pack(">I", values.size)
    return bytes(head) + bits.pack(values, modulus_bits)


def decode_masked_input(data: bytes, count: int, modulus_bits: int) -> np.ndarray:
    """Exactly ``count`` values of ``modulus_bits`` bits: sizes checked before unpacking."""
    if not 1 <= count <= MAX_LENGTH + 1 or not 1 <= modulus_bits <= 64:
        raise ValueError("bad expected masked-input shape")
    r = _Reader(data, Kind.MASKED_INPUT, masked_input_size(count, modulus_bits))
    if r.u8() != modulus_bits or r.u32() != count:
        raise SecAggMessageError("malformed", "masked input of another shape")
    if len(data) != masked_input_size(count, modulus_bits):
        raise SecAggMessageError("malformed", "masked input of the wrong length")
    return bits.unpack(memoryview(data)[r.pos :], count, modulus_bits)


def encode_survivors(msg: SurvivorList) -> bytes:
    out = _header(Kind.SURVIVORS)
    for ids in (msg.survivors, msg.dropped):
        out += struct.pack(">H", len(ids)) + b"".join(_text(i) for i in ids)
    return bytes(out)


def decode_survivors(data: bytes) -> SurvivorList:
    r = _Reader(data, Kind.SURVIVORS, MAX_CONTROL_BYTES)
    survivors = [r.text() for _ in range(r.count(2))]
    dropped = [r.text() for _ in range(r.count(2))]
    r.end()
    _unique(survivors)
    _unique(dropped)
    return SurvivorList(tuple(survivors), tuple(dropped))


def encode_signature(signature: bytes) -> bytes:
    return bytes(_header(Kind.CONSISTENCY) + signature)


def decode_signature(data: bytes) -> bytes:
    r = _Reader(data, Kind.CONSISTENCY, MAX_CONTROL_BYTES)
    out = r.raw(SIGNATURE_BYTES)
    r.end()
    return out


def encode_signatures(entries: tuple[tuple[str, bytes], ...]) -> bytes:
    out = _header(Kind.SIGNATURES) + struct.pack(">H", len(entries))
    for device_id, signature in entries:
        out += _text(device_id) + signature
    return bytes(out)


def decode_signatures(data: bytes) -> tuple[tuple[str, bytes], ...]:
    r = _Reader(data, Kind.SIGNATURES, MAX_CONTROL_BYTES)
    entries = [(r.text(), r.raw(SIGNATURE_BYTES)) for _ in range(r.count(2 + SIGNATURE_BYTES))]
    r.end()
    _unique([e[0] for e in entries])
    return tuple(entries)


def encode_unmask(entries: tuple[Reveal, ...]) -> bytes:
    out = _header(Kind.UNMASK) + struct.pack(">H", len(entries))
    for e in entries:
        out += _text(e.owner) + bytes([e.secret]) + _share(e.share)
    return bytes(out)


def decode_unmask(data: bytes) -> tuple[Reveal, ...]:
    r = _Reader(data, Kind.UNMASK, MAX_CONTROL_BYTES)
    entries = []
    for _ in range(r.count(2 + 1 + 2 + ELEMENT_BYTES)):
        owner = r.text()
        kind = r.u8()
        if kind not in (Secret.SELF_MASK, Secret.MASK_KEY):
            raise SecAggMessageError("malformed", "unknown secret kind")
        entries.append(Reveal(owner, Secret(kind), r.share()))
    r.end()
    _unique([e.owner for e in entries])
    return tuple(entries)


def encode_bundle(bundle: ShareBundle) -> bytes:
    return bytes(_header(Kind.SHARE_BUNDLE) + _share(bundle.self_mask) + _share(bundle.mask_key))


def decode_bundle(data: bytes) -> ShareBundle:
    r = _Reader(data, Kind.SHARE_BUNDLE, MAX_SEALED_BYTES)
    out = ShareBundle(r.share(), r.share())
    r.end()
    return out


def masked_input_count(data: bytes) -> int:
    """The element count a masked input declares (to fix the round's length from the first
    one when the server was not told it); the full decode checks everything else."""
    r = _Reader(data[: _HEADER + 5], Kind.MASKED_INPUT, _HEADER + 5)
    r.u8()
    count = r.u32()
    if not 2 <= count <= MAX_LENGTH + 1:
        raise SecAggMessageError("malformed", "bad masked-input length")
    return count
