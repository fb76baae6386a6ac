"""Devices' Ed25519 identity keys, as secure rounds read them (``engine.DeviceKeys``).

Until enrolment registers a key with each device (the device-identity work: the store's
``devices.public_key``), a device hands its public key over with its first secure-round
message and the server keeps the first key it saw for each device (trust on first use);
a different key later is refused. :meth:`IdentityKeys.device_keys` is the one place keys
are read, so pointing it at the registered keys changes nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flotilla.core.errors import AuthError, WireError

#: A raw Ed25519 public key.
KEY_BYTES = 32


@dataclass(slots=True)
class IdentityKeys:
    """Device id -> its raw 32-byte Ed25519 public key."""

    _keys: dict[str, bytes] = field(default_factory=dict)

    def register(self, device_id: str, key: bytes) -> None:
        """Keep ``key`` as the device's, unless it has another (AuthError)."""
        if len(key) != KEY_BYTES:
            raise WireError(f"an identity key is {KEY_BYTES} raw bytes, not {len(key)}")
        held = self._keys.setdefault(device_id, bytes(key))
        if held != key:
            raise AuthError("this device registered another identity key")

    async def device_keys(self, device_ids: Sequence[str]) -> Mapping[str, bytes]:
        """The keys of those of ``device_ids`` that have one."""
        return {d: self._keys[d] for d in device_ids if d in self._keys}
