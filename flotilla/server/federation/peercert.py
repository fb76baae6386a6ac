"""A device's client certificate as the core sees it, whichever edge verified it, and the
one rule binding it to a device id (mutual TLS, ``flotilla server --tls-client-ca``).

The edges verify the chain (TLS does) and hand over only the names the certificate
carries; the device id is the subject's common name, or any of its DNS or URI subject
alternative names. At enrolment the new device takes the certificate's id; every later
call's certificate must name the device the credential authenticates."""

from __future__ import annotations

import re
from dataclasses import dataclass

from flotilla.core.errors import AuthError

__all__ = ["DEVICE_ID", "PeerCertificate", "check_bound"]

#: What a certificate may name as a device id (it becomes a column and a metric label).
DEVICE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")


@dataclass(frozen=True, slots=True)
class PeerCertificate:
    """The names of a verified client certificate: its subject CN first (``""`` if none),
    then its DNS and URI subject alternative names."""

    common_name: str
    alt_names: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.common_name, *self.alt_names) if n)

    def device_id(self) -> str:
        """The id a device enrolling with this certificate gets: its CN (else its first
        alternative name); AuthError if it names none that can be an id."""
        for name in self.names:
            if DEVICE_ID.fullmatch(name):
                return name
        raise AuthError(
            "the client certificate names no usable device id: its subject CN must be "
            "1-128 letters, digits or . _ : @ - (starting with a letter or digit)"
        )


def check_bound(cert: PeerCertificate | None, device_id: str, required: bool) -> None:
    """Refuse a call whose certificate does not name ``device_id`` (or that has none, when
    ``required``): a device's credential is only good with its own certificate."""
    if cert is None:
        if required:
            raise AuthError("this server requires a client certificate (mutual TLS)")
        return
    if device_id not in cert.names:
        raise AuthError(
            f"the client certificate names {', '.join(cert.names) or 'no one'}, "
            f"not device {device_id!r}"
        )
