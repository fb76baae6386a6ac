"""Every network wait in one place, so none is ever unbounded."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Deadlines in seconds for each phase of the agent protocol."""

    connect: float = 10.0
    enrol: float = 15.0
    #: How long the server holds a poll open when it has no task.
    poll_hold: float = 10.0
    #: Client deadline for one poll: the hold plus slack.
    poll: float = 20.0
    heartbeat: float = 5.0
    #: How long the server holds a server-less round's report that was not asked to upload
    #: (until the round closes or it is asked); the agent's deadline adds ``heartbeat``.
    report_hold: float = 5.0
    #: Per-call deadline for streaming a model or an update, whatever its size.
    transfer: float = 300.0
    operator: float = 60.0
    #: An upload that sends nothing for this long is dropped (its buffer freed).
    upload_idle: float = 15.0
    #: A device silent for this long is considered gone and its slot freed.
    liveness: float = 30.0
    #: Seconds between heartbeats while an agent trains.
    heartbeat_every: float = 5.0
