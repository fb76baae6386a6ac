"""The JSON of every read-model value, in one place: what ``/api/v1`` answers and what the
dashboard's page reads (the shapes of ``docs/http-api.md`` and the OpenAPI document).

Metrics are floats a device or task reported; a NaN or infinity among them is rendered as
``null`` (JSON has no such numbers, and a browser's ``JSON.parse`` refuses them).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from flotilla.dashboard.model import (
    Change,
    DeviceStatus,
    JobView,
    ParticipantView,
    RoundView,
    VolunteerRunView,
)

__all__ = [
    "change_json",
    "device_json",
    "dumps",
    "error_json",
    "job_json",
    "join_array",
    "metrics_json",
    "number",
    "round_json",
    "volunteer_run_json",
]


def number(value: float) -> float | None:
    """A finite float, or None where JSON has no number for it."""
    f = float(value)
    return f if math.isfinite(f) else None


def metrics_json(metrics: Mapping[str, float]) -> dict[str, float | None]:
    return {str(k): number(v) for k, v in metrics.items()}


def job_json(job: JobView) -> dict[str, Any]:
    """A ``Job``: the fields of ``flotilla job status --json``, plus ``updated_at``."""
    return {
        "id": job.id,
        "name": job.name,
        "state": job.state,
        "task": job.task,
        "rounds_committed": job.rounds_committed,
        "rounds_total": job.rounds_total,
        "metrics": metrics_json(job.metrics),
        "created_at": number(job.created_at),
        "updated_at": number(job.updated_at),
    }


def _participant_json(p: ParticipantView) -> dict[str, Any]:
    return {
        "device_id": p.device_id,
        "num_samples": p.num_samples,
        "metrics": metrics_json(p.metrics),
        "device_class": p.device_class,
    }


def round_json(r: RoundView) -> dict[str, Any]:
    """A ``Round``: ``job status --json --rounds``'s shape plus the round's account."""
    return {
        "round": r.round,
        "metrics": metrics_json(r.metrics),
        "participants": list(r.participants),
        "devices": [_participant_json(p) for p in r.devices],
        "started_at": number(r.started_at),
        "committed_at": number(r.committed_at),
        "checkpoint_sha256": r.checkpoint_sha256,
        "selected": list(r.selected),
        "failures": [{"device_id": f.device_id, "reason": f.reason} for f in r.failures],
        "stale": list(r.stale),
        "bytes_up": r.bytes_up,
        "bytes_down": r.bytes_down,
        "decisions": list(r.decisions),
    }


def device_json(d: DeviceStatus) -> dict[str, Any]:
    """A ``Device``: ``devices list --json``'s facts plus class, failures and eligibility."""
    return {
        "id": d.id,
        "state": d.state,
        "job": d.job,
        "device_class": d.device_class,
        "tasks": list(d.tasks),
        "gflops": number(d.gflops),
        "upload_bytes_per_s": number(d.upload_bytes_per_s),
        "last_seen": number(d.last_seen),
        "rounds_served": d.rounds_served,
        "failures": {str(k): int(v) for k, v in d.failures.items()},
        "ineligible_reason": d.ineligible_reason,
        "samples": {str(k): int(v) for k, v in d.samples.items()},
    }


def volunteer_run_json(v: VolunteerRunView) -> dict[str, Any]:
    return {
        "run": v.run,
        "task": v.task,
        "peers_online": v.peers_online,
        "samples_per_s": number(v.samples_per_s),
        "loss_history": [[number(t), number(loss)] for t, loss in v.loss_history],
        "maddrs": list(v.maddrs),
    }


def change_json(change: Change) -> dict[str, str]:
    """The ``data`` of one ``change`` server-sent event."""
    return {"kind": change.kind, "job_id": change.job_id if change.kind == "job" else ""}


def error_json(code: str, message: str) -> dict[str, Any]:
    """The body of every 4xx/5xx answer: a stable ``code`` and what to do about it."""
    return {"error": {"code": code, "message": message}}


def dumps(value: Any) -> bytes:
    """Compact JSON bytes; refuses NaN (the renderers above never leave one)."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def join_array(key: str, items: Iterable[bytes]) -> bytes:
    """``{"key":[item,item,...]}`` from items already rendered (cached fragments)."""
    return b'{"' + key.encode() + b'":[' + b",".join(items) + b"]}"
