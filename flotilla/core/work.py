"""A device's work order: what the server hands a device for one round.

Plain values, so every edge (gRPC today, HTTP later, in-process in tests) and both sides
of it speak the same type; the engine's own ``TrainTask`` adds what only the server needs
(layout, codec, transport) and is cut down to this at the edge.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RoundRef:
    """One attempt at one round of one job: what every message about a round quotes."""

    job_id: str
    round: int
    #: Unique per attempt at a round, so a message from an earlier attempt is stale.
    round_token: str


@dataclass(frozen=True, slots=True)
class WorkOrder:
    """One round's work for a device: the model to fetch, the config to train with."""

    job_id: str
    round: int
    round_token: str
    #: The task's entry point name.
    task: str
    #: The job spec's train, data and compression sections (and layout, group plan), JSON.
    config_json: str
    model_sha256: str
    model_size: int
    #: When the round closes, as ``time.time()``.
    deadline: float
    seed: int
    #: Downlink delta: a device holding the model ``delta_base_sha256`` may instead fetch
    #: this codec-compressed change and add it, which must give ``model_sha256`` exactly.
    delta_base_sha256: str = ""
    delta_sha256: str = ""
    delta_size: int = 0

    @property
    def ref(self) -> RoundRef:
        return RoundRef(self.job_id, self.round, self.round_token)
