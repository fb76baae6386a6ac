"""``flotilla server --rate-limit`` and ``--max-connections``, read into ``RateLimits``."""

from __future__ import annotations

from typing import Any


def rate_limits(given: list[str], max_connections: int | None) -> Any:
    """``flotilla server --rate-limit KIND=RATE/BURST`` (repeatable) and
    ``--max-connections N`` as the server's ``RateLimits``."""
    from dataclasses import replace

    from flotilla.core.errors import SpecError
    from flotilla.server.federation.ratelimit import RateLimits

    fields = {"poll": ("polls_per_s", "poll_burst"), "upload": ("uploads_per_s", "upload_burst"),
              "enrol": ("enrols_per_s", "enrol_burst")}  # fmt: skip
    changes: dict[str, Any] = {}
    for item in given:
        kind, _, value = item.partition("=")
        rate, _, burst = value.partition("/")
        try:
            rate_field, burst_field = fields[kind.strip()]
            changes[rate_field] = float(rate)
            if burst:
                changes[burst_field] = int(burst)
        except (KeyError, ValueError):
            raise SpecError(
                f"--rate-limit: want poll|upload|enrol=RATE[/BURST] (e.g. poll=10/50), got {item!r}"
            ) from None
    if max_connections is not None:
        changes["http_connections_per_address"] = max_connections
        changes["grpc_calls_per_address"] = max_connections
    try:
        return replace(RateLimits(), **changes)
    except ValueError as exc:
        raise SpecError(f"--rate-limit: {exc}") from None
