"""The signed statement of an update: every field is bound, keys are kept owner-only."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import pytest

from flotilla.core.errors import WireError
from flotilla.core.identity import (
    KEY_FILE,
    NONCE_BYTES,
    STATEMENT_TAG,
    DeviceIdentity,
    digest_bytes,
    public_key,
    update_statement,
    verify_update,
)

pytestmark = pytest.mark.timeout(30)

SHA = hashlib.sha256(b"update").digest()
NONCE = bytes(range(NONCE_BYTES))
BASE = {"job_id": "job-1", "round": 3, "round_token": "tok-a", "payload_sha256": SHA,
        "nonce": NONCE}  # fmt: skip
CHANGED = {
    "job_id": "job-2",
    "round": 4,
    "round_token": "tok-b",
    "payload_sha256": hashlib.sha256(b"updatf").digest(),
    "nonce": bytes([1]) + NONCE[1:],
}


def test_a_signature_verifies_over_its_own_statement_only() -> None:
    me = DeviceIdentity.generate()
    signed = me.sign_update(**BASE)
    statement = update_statement(**BASE)
    assert statement.startswith(STATEMENT_TAG)
    assert verify_update(me.public_key_hex, statement, signed.signature)
    assert signed.nonce == NONCE


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_changing_any_one_field_breaks_the_signature(field: str) -> None:
    me = DeviceIdentity.generate()
    signature = me.sign_update(**BASE).signature
    other = update_statement(**{**BASE, field: CHANGED[field]})
    assert other != update_statement(**BASE)
    assert not verify_update(me.public_key_hex, other, signature)


def test_another_devices_key_or_a_flipped_signature_bit_fails() -> None:
    me, them = DeviceIdentity.generate(), DeviceIdentity.generate()
    statement = update_statement(**BASE)
    signature = me.sign(statement)
    assert not verify_update(them.public_key_hex, statement, signature)
    flipped = bytes([signature[0] ^ 1]) + signature[1:]
    assert not verify_update(me.public_key_hex, statement, flipped)
    assert not verify_update(me.public_key_hex, statement, signature[:-1])
    assert not verify_update("00" * 32 + "zz", statement, signature)


def test_length_prefixes_keep_fields_from_sliding_into_each_other() -> None:
    a = update_statement(**{**BASE, "job_id": "ab", "round_token": "c"})
    b = update_statement(**{**BASE, "job_id": "a", "round_token": "bc"})
    assert a != b


def test_fresh_nonces_differ_and_bad_fields_are_refused() -> None:
    me = DeviceIdentity.generate()
    fields = {k: v for k, v in BASE.items() if k != "nonce"}
    assert me.sign_update(**fields).nonce != me.sign_update(**fields).nonce
    for bad in ({"nonce": b"short"}, {"payload_sha256": b"x" * 31}, {"round": -1},
                {"job_id": "j" * 2000}):  # fmt: skip
        with pytest.raises(WireError):
            update_statement(**{**BASE, **bad})
    with pytest.raises(WireError, match="hex"):
        digest_bytes("A" * 64)
    assert digest_bytes(SHA.hex()) == SHA
    with pytest.raises(WireError, match="64 lowercase hex"):
        public_key("ab")


def test_the_key_file_is_owner_only_and_loads_back(tmp_path: Path) -> None:
    path = tmp_path / KEY_FILE
    assert DeviceIdentity.load(path) is None
    me = DeviceIdentity.generate()
    me.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = DeviceIdentity.load(path)
    assert again is not None and again.public_key_hex == me.public_key_hex
    path.chmod(0o644)
    assert DeviceIdentity.load(path) is not None
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.write_text("not a key")
    with pytest.raises(WireError, match="PEM"):
        DeviceIdentity.load(path)
