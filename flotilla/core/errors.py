"""One exception tree for the whole platform.

::

    FlotillaError
    ├── SpecError            a job spec or experiment file is wrong (names the field)
    │   └── ConfigError      a setting that cannot work as given (a SecAgg+ sum would overflow)
    ├── WireError            bytes from the network are malformed, oversized or unsafe
    │   └── IntegrityError   a blob's SHA-256 does not match
    ├── UpdateRejected       a well-formed update that must not be aggregated
    │   └── StaleRoundError  the update is for a round that is no longer open
    ├── AuthError            missing or wrong credentials
    │   └── ForbiddenError   right credentials, but not allowed to do this (a read token)
    ├── NotFoundError        an unknown job, device or blob
    ├── Unreachable          the server is away, busy or too slow: worth trying again
    │   ├── RateLimited      this caller sent too much too fast: wait retry_after_s
    │   ├── StorageUnavailable  the database or the disk cannot take writes now
    │   └── Redirected       another server of the deployment wants this device
    ├── TaskLoadError        a task entry point cannot be imported
    ├── ConflictError        a write that contradicts what is stored
    │   ├── RoundConflict    a round commit out of order, repeated, or on a finished job
    │   ├── JobStateError    a state change out of a terminal state
    │   └── LeaseLost        this server no longer holds the job's lease
    ├── BudgetExhausted      a job's privacy budget allows no further round
    ├── RunRecordError       a volunteer run record is missing, malformed or badly signed
    └── SimulationStalled    every simulated task waits for what no timer will bring

Transports map these to their own status codes at the edge; the CLI maps them to exit codes.
"""

from __future__ import annotations


class FlotillaError(Exception):
    """Root of every error Flotilla raises on purpose."""


class SpecError(FlotillaError, ValueError):
    """A spec file or override is invalid; the message names the field and the file."""


class ConfigError(SpecError):
    """Settings valid one by one that cannot work together or at this size (the SecAgg+
    modulus too small for the round's weighted sum); a SpecError, so submission refuses it."""


class WireError(FlotillaError, ValueError):
    """Bytes that came over a network are malformed, oversized or not allowed."""


class IntegrityError(WireError):
    """A blob's content does not match its declared SHA-256 or size."""


class UpdateRejected(FlotillaError):
    """An update that decodes but must not reach the aggregator (shape, NaN, norm...)."""


class StaleRoundError(UpdateRejected):
    """An update for a round that has closed or never opened for this device."""


class AuthError(FlotillaError):
    """Missing, malformed or wrong credentials."""


class ForbiddenError(AuthError):
    """Valid credentials that do not allow the call (a read-only token on a write)."""


class NotFoundError(FlotillaError, KeyError):
    """An unknown job, device, round or blob."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "not found"


class Unreachable(FlotillaError):
    """The server did not answer in time, is not running, or is too busy: a transport's
    one retryable error (connection refused or reset, deadline passed, overloaded)."""


class AnswerLost(Unreachable):
    """A request went out whole but its answer never came (the stream ended first): whether
    it took effect on the other side is unknown."""


class RateLimited(Unreachable):
    """The caller went over its rate limit; others are unaffected. Retry after
    ``retry_after_s`` seconds (an HTTP 429 ``Retry-After``, a gRPC RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StorageUnavailable(Unreachable):
    """The database is unreachable (restarting, connection lost) or the disk is full: the
    call did not happen, or its outcome is unknown. Retry later; the server itself resumes
    each job from its last committed round once storage is back."""


class Redirected(Unreachable):
    """Another server of the deployment runs jobs that lack devices, and this one has no
    work for the caller: a device tries the next server it was given (or reconnects
    through its load balancer)."""


class TaskLoadError(FlotillaError, ImportError):
    """A task entry point (``package.module:Name``) cannot be loaded."""


class ConflictError(FlotillaError, ValueError):
    """A write that contradicts what is stored (duplicate id, illegal transition...)."""


class RoundConflict(ConflictError):
    """A round commit that is out of order, repeated, or for a finished job; nothing written."""


class JobStateError(ConflictError):
    """A state change out of a terminal state (completed, failed, cancelled)."""


class LeaseLost(ConflictError):
    """A round commit by a server that no longer holds its job's lease (it expired, or
    another process of the deployment took the job over): refused, nothing written."""


class BudgetExhausted(FlotillaError):
    """Starting the next round would take the job past its privacy (epsilon) budget."""


class RunRecordError(FlotillaError, ValueError):
    """A run record is missing, malformed, unsigned, or signed by the wrong key."""


class SimulationStalled(FlotillaError, RuntimeError):
    """Every simulated task waits for something no timer will ever bring."""
