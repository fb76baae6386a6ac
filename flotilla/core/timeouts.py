"""Every network and process wait in one place, so none is ever unbounded.

Each field is a duration in seconds (hence ``_s``). Parts take the ``Timeouts`` (or the
one field they need) from whoever builds them: ``AgentConfig``, ``ServerConfig``,
``VolunteerOptions`` and ``RemoteServer`` carry one; a part built without one gets these
defaults. Waits that belong to one job or run travel with it instead, because its author
sets them: the job spec's ``round_deadline_s``, a p2p plan's ``matchmaking_s`` and
``chunk_timeout_s``, a volunteer run record's averaging timeouts (hivemind's names).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Deadlines in seconds for each phase of the agent protocol and each child process."""

    # --- agent protocol (both sides) ---------------------------------------------------
    connect_s: float = 10.0
    enrol_s: float = 15.0
    #: How long the server holds a poll open when it has no task.
    poll_hold_s: float = 10.0
    #: Client deadline for one poll: the hold plus slack.
    poll_s: float = 20.0
    heartbeat_s: float = 5.0
    #: How long the server holds a server-less round's report that was not asked to upload
    #: (until the round closes or it is asked); the agent's deadline adds ``heartbeat_s``.
    report_hold_s: float = 5.0
    #: Per-call deadline for streaming a model or an update, whatever its size.
    transfer_s: float = 300.0
    #: Deadline for one operator call (submit, list, cancel...).
    operator_s: float = 60.0
    #: Deadline for streaming a model export to an operator.
    export_s: float = 600.0
    #: An upload that sends nothing for this long is dropped (its buffer freed).
    upload_idle_s: float = 15.0
    #: A device silent for this long is considered gone and its slot freed.
    liveness_s: float = 30.0
    #: Seconds between heartbeats while an agent trains.
    heartbeat_every_s: float = 5.0
    #: An agent stops reporting a server-less round this long before the round's deadline.
    report_margin_s: float = 5.0
    #: Deadline for the agent's goodbye when it stops (best effort).
    leave_s: float = 2.0
    #: An upload may finish this long after its round's deadline (a device that started in
    #: time is not cut off by the clock it raced).
    upload_grace_s: float = 5.0

    #: Calls in flight when the server stops get this long to finish.
    server_stop_s: float = 1.0
    #: After the database or the disk failed a job (restart, full disk), the server retries,
    #: doubling its pause up to this, and resumes the job from its last committed round.
    outage_backoff_max_s: float = 30.0
    #: A job's lease (several servers on one database share the jobs): its holder renews
    #: it every third of this; another server takes the job over within 5/3 of it after
    #: the holder dies.
    job_lease_s: float = 10.0

    # --- child processes and peers -----------------------------------------------------
    #: A hosted child (rendezvous, volunteer coordinator) must be ready within this.
    child_start_s: float = 120.0
    #: A child told to stop (a hosted peer, the demo's agents) gets this long before SIGKILL.
    child_stop_s: float = 15.0
    #: A hivemind DHT node must start within this.
    dht_start_s: float = 30.0
    #: A hivemind averager's background process must be ready within this; one that is not
    #: (a fork that inherited a lock another thread held) is killed and its round given up.
    averager_start_s: float = 30.0
    #: A volunteer waits this long for its run's record to appear in the DHT.
    record_wait_s: float = 20.0
    #: A hivemind optimizer's shutdown waits at most this long for its background work.
    swarm_shutdown_s: float = 5.0
    #: After Ctrl-C, how long a peer may take leaving its swarm before it ends at once
    #: (hivemind may wait out a round's timeout; Ctrl-C stops within 5 s).
    swarm_leave_s: float = 3.0
    #: After Ctrl-C, how long a coordinator lets its duty in progress (a checkpoint's
    #: download, a DHT call) end before it shuts down under it (within ``swarm_leave_s``).
    coordinator_stop_s: float = 0.5
    #: A simulation training worker must say hello within this.
    worker_start_s: float = 120.0
    #: A simulation worker's share of one round must come back within this.
    worker_round_s: float = 3600.0
    #: A simulation worker told to stop is killed after this long.
    worker_stop_s: float = 10.0
    #: SQLite waits this long for another writer's lock before failing.
    db_busy_s: float = 30.0
