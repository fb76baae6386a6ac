"""Shamir secret sharing over the Mersenne prime 2**521 - 1: a 32-byte secret is one field
element. Our one own piece of cryptography (allowed: there is no library primitive)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

PRIME = (1 << 521) - 1
#: A field element on the wire: 66 bytes, big-endian.
ELEMENT_BYTES = 66
#: Share indices are 1..MAX_SHARES (0 is where the secret lives).
MAX_SHARES = 0xFFFF


@dataclass(frozen=True, slots=True)
class Share:
    x: int
    y: int

    def __post_init__(self) -> None:
        if not 1 <= self.x <= MAX_SHARES:
            raise ValueError(f"share index {self.x} not in [1, {MAX_SHARES}]")
        if not 0 <= self.y < PRIME:
            raise ValueError("share value outside the field")


def _random_element(randbytes: Callable[[int], bytes]) -> int:
    # 72 bytes = 576 bits reduced mod a 521-bit prime: bias below 2**-55.
    return int.from_bytes(randbytes(72), "big") % PRIME


def split(
    secret: bytes, threshold: int, xs: Sequence[int], randbytes: Callable[[int], bytes]
) -> list[Share]:
    """Shares of ``secret`` (at most 64 bytes) at ``xs``: any ``threshold`` reconstruct."""
    if len(secret) > 64:
        raise ValueError("a secret is at most 64 bytes")
    if not 1 <= threshold <= len(xs) or len(set(xs)) != len(xs):
        raise ValueError("need 1 <= threshold <= number of distinct share indices")
    coefficients = [int.from_bytes(secret, "big")]
    coefficients += [_random_element(randbytes) for _ in range(threshold - 1)]
    shares = []
    for x in xs:
        y = 0
        for c in reversed(coefficients):  # Horner
            y = (y * x + c) % PRIME
        shares.append(Share(x, y))
    return shares


def lagrange_at_zero(xs: tuple[int, ...]) -> tuple[int, ...]:
    """The coefficients l_i with f(0) = sum_i l_i * f(x_i); refuses repeated indices."""
    if not xs or len(set(xs)) != len(xs):
        raise ValueError("need at least one share and distinct share indices")
    out = []
    for i, xi in enumerate(xs):
        num, den = 1, 1
        for j, x in enumerate(xs):
            if j != i:
                num = num * x % PRIME
                den = den * (x - xi) % PRIME
        out.append(num * pow(den, -1, PRIME) % PRIME)
    return tuple(out)


def interpolate(
    shares: Sequence[Share], cache: dict[tuple[int, ...], tuple[int, ...]] | None = None
) -> int:
    """The polynomial through ``shares`` at 0; ``cache`` keeps coefficients by index set."""
    xs = tuple(s.x for s in shares)
    coefficients = cache.get(xs) if cache is not None else None
    if coefficients is None:
        coefficients = lagrange_at_zero(xs)
        if cache is not None and len(cache) < 4096:
            cache[xs] = coefficients
    return sum(c * s.y for c, s in zip(coefficients, shares, strict=True)) % PRIME


def reconstruct(
    shares: Sequence[Share],
    threshold: int,
    size: int = 32,
    cache: dict[tuple[int, ...], tuple[int, ...]] | None = None,
) -> bytes:
    """The ``size``-byte secret from the first ``threshold`` shares (ValueError if there
    are fewer, if indices repeat, or if the result cannot be such a secret)."""
    if len(shares) < threshold:
        raise ValueError(f"{len(shares)} shares, {threshold} needed")
    if len({s.x for s in shares}) != len(shares):
        raise ValueError("repeated share index")
    value = interpolate(shares[:threshold], cache)
    if value >= 1 << (8 * size):
        raise ValueError("the shares do not hold a secret of this size")
    return value.to_bytes(size, "big")


def element_bytes(value: int) -> bytes:
    return value.to_bytes(ELEMENT_BYTES, "big")
