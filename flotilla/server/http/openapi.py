"""The OpenAPI 3.1 document of the HTTP API, served at ``/openapi.json`` and rendered by the
docs site; importable without starting anything.

Built from one table of operations (:data:`OPERATIONS`), the same one the auth test walks:
every route's scope decides its security and its 401/403 answers, so the document cannot
promise a route is public while the edge wants a token.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from flotilla import __version__
from flotilla.core.access import Scope
from flotilla.core.records import JOB_STATES

ERROR_CODES = (
    "unauthorized",
    "forbidden",
    "not_found",
    "bad_request",
    "invalid_spec",
    "conflict",
    "payload_too_large",
    "method_not_allowed",
    "unavailable",
    "internal",
)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _obj(props: dict[str, Any], required: tuple[str, ...] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props if required is None else required),
    }


STRING: dict[str, Any] = {"type": "string"}
NUMBER: dict[str, Any] = {"type": "number"}
INTEGER: dict[str, Any] = {"type": "integer", "minimum": 0}
STRINGS: dict[str, Any] = {"type": "array", "items": STRING}
#: Metric name -> value; null where the value was NaN or infinite.
METRICS: dict[str, Any] = {"type": "object", "additionalProperties": {"type": ["number", "null"]}}

SCHEMAS: dict[str, Any] = {
    "Error": _obj(
        {"error": _obj({"code": {"type": "string", "enum": list(ERROR_CODES)}, "message": STRING})}
    ),
    "Job": _obj(
        {
            "id": STRING,
            "name": STRING,
            "state": {"type": "string", "enum": list(JOB_STATES)},
            "task": STRING,
            "rounds_committed": INTEGER,
            "rounds_total": INTEGER,
            "metrics": METRICS,
            "created_at": NUMBER,
            "updated_at": NUMBER,
        }
    ),
    "Jobs": _obj({"jobs": {"type": "array", "items": _ref("Job")}}),
    "Participant": _obj(
        {"device_id": STRING, "num_samples": INTEGER, "metrics": METRICS, "device_class": STRING}
    ),
    "Round": _obj(
        {
            "round": INTEGER,
            "metrics": METRICS,
            "participants": STRINGS,
            "devices": {"type": "array", "items": _ref("Participant")},
            "started_at": NUMBER,
            "committed_at": NUMBER,
            "checkpoint_sha256": STRING,
            "selected": STRINGS,
            "failures": {
                "type": "array",
                "items": _obj({"device_id": STRING, "reason": STRING}),
            },
            "stale": STRINGS,
            "bytes_up": INTEGER,
            "bytes_down": INTEGER,
            "decisions": STRINGS,
        }
    ),
    "Rounds": _obj({"rounds": {"type": "array", "items": _ref("Round")}}),
    "Device": _obj(
        {
            "id": STRING,
            "state": {"type": "string", "enum": ["offline", "idle", "busy", "ineligible"]},
            "job": STRING,
            "device_class": STRING,
            "tasks": STRINGS,
            "gflops": NUMBER,
            "upload_bytes_per_s": NUMBER,
            "last_seen": NUMBER,
            "rounds_served": INTEGER,
            "failures": {"type": "object", "additionalProperties": INTEGER},
            "ineligible_reason": STRING,
            "samples": {
                "type": "object",
                "additionalProperties": INTEGER,
                "description": "Task -> training samples the device holds, as it last "
                "reported; a task it has not counted is absent.",
            },
        }
    ),
    "Devices": _obj({"devices": {"type": "array", "items": _ref("Device")}}),
    "DeviceHistory": _obj(
        {
            "samples": {
                "type": "array",
                "items": _obj({"t": NUMBER, "idle": INTEGER, "busy": INTEGER, "offline": INTEGER}),
            }
        }
    ),
    "VolunteerRuns": _obj(
        {
            "volunteer_runs": {
                "type": "array",
                "items": _obj(
                    {
                        "run": STRING,
                        "task": STRING,
                        "peers_online": INTEGER,
                        "samples_per_s": NUMBER,
                        "loss_history": {
                            "type": "array",
                            "items": {
                                "type": "array",
                                "items": {"type": ["number", "null"]},
                                "minItems": 2,
                                "maxItems": 2,
                            },
                        },
                        "maddrs": STRINGS,
                    }
                ),
            }
        }
    ),
    "Whoami": _obj(
        {
            "scope": {"type": "string", "enum": [s.value for s in Scope]},
            "source": {"type": "string", "enum": ["server", "simulation"]},
        }
    ),
    "Status": _obj({"status": STRING}),
    "RevokedDevice": _obj({"device_id": STRING, "revoked_at": {"type": "number"}}),
}

JOB_ID = {
    "name": "id",
    "in": "path",
    "required": True,
    "description": "A job id, as `GET /api/v1/jobs` lists them.",
    "schema": STRING,
}
DEVICE_ID = {
    "name": "id",
    "in": "path",
    "required": True,
    "description": "A device id, as `GET /api/v1/devices` lists them.",
    "schema": STRING,
}
SINCE = {
    "name": "since",
    "in": "query",
    "required": False,
    "description": "Only rounds numbered above this (the live page fetches increments).",
    "schema": {"type": "integer", "minimum": 0, "default": 0},
}
JOB_NAME = {
    "name": "job",
    "in": "query",
    "required": False,
    "description": "Of an experiment file's `[[jobs]]`, submit only the one of this name.",
    "schema": STRING,
}


@dataclass(frozen=True, slots=True)
class Operation:
    method: str
    path: str
    operation_id: str
    summary: str
    #: None: public; READ: any token; OPERATOR: the operator token only.
    scope: Scope | None
    #: (status, media type, schema) of the success answer.
    ok: tuple[int, str, dict[str, Any]]
    params: tuple[dict[str, Any], ...] = ()
    #: Error statuses besides the token's (401, 403), each answered with an ``Error``.
    errors: tuple[int, ...] = ()
    body: bool = False


JSON = "application/json"
OPERATIONS: tuple[Operation, ...] = (
    Operation("get", "/api/v1/whoami", "whoami", "The caller's scope and what this server serves",
              Scope.READ, (200, JSON, _ref("Whoami"))),
    Operation("get", "/api/v1/jobs", "listJobs", "Every job, with its latest round's metrics",
              Scope.READ, (200, JSON, _ref("Jobs"))),
    Operation("post", "/api/v1/jobs", "submitJob",
              "Submit a job spec (TOML, as `flotilla job submit` reads it)", Scope.OPERATOR,
              (201, JSON, _ref("Job")), (JOB_NAME,), (400, 409, 413), body=True),
    Operation("get", "/api/v1/jobs/{id}", "getJob", "One job", Scope.READ,
              (200, JSON, _ref("Job")), (JOB_ID,), (404,)),
    Operation("get", "/api/v1/jobs/{id}/rounds", "listRounds",
              "A job's committed rounds, oldest first, with their accounts", Scope.READ,
              (200, JSON, _ref("Rounds")), (JOB_ID, SINCE), (400, 404)),
    Operation("post", "/api/v1/jobs/{id}/cancel", "cancelJob", "Cancel a job", Scope.OPERATOR,
              (200, JSON, _ref("Job")), (JOB_ID,), (404, 409)),
    Operation("get", "/api/v1/jobs/{id}/model", "exportModel",
              "The job's latest model as safetensors", Scope.READ,
              (200, "application/octet-stream", {"type": "string", "format": "binary"}),
              (JOB_ID,), (404,)),
    Operation("get", "/api/v1/devices", "listDevices", "Every enrolled device", Scope.READ,
              (200, JSON, _ref("Devices"))),
    Operation("post", "/api/v1/devices/{id}/revoke", "revokeDevice",
              "Revoke a device at once: its credential and key stop working on every edge, "
              "the rounds it owes are given up and an update it is uploading is refused",
              Scope.OPERATOR, (200, JSON, _ref("RevokedDevice")), (DEVICE_ID,), (404,)),
    Operation("get", "/api/v1/devices/history", "deviceHistory",
              "Device counts by state over time, oldest first", Scope.READ,
              (200, JSON, _ref("DeviceHistory"))),
    Operation("get", "/api/v1/volunteer-runs", "listVolunteerRuns",
              "The volunteer runs this server coordinates", Scope.READ,
              (200, JSON, _ref("VolunteerRuns"))),
    Operation("get", "/api/v1/events", "events",
              "Server-sent events: `event: change`, data `{kind, job_id}`; `: keepalive` "
              "comments", Scope.READ, (200, "text/event-stream", STRING)),
    Operation("get", "/metrics", "metrics", "Prometheus metrics (text format)", Scope.READ,
              (200, "text/plain", STRING)),
    Operation("get", "/healthz", "healthz", "Whether the process serves", None,
              (200, JSON, _ref("Status"))),
    Operation("get", "/readyz", "readyz", "Whether the store is open and jobs resumed", None,
              (200, JSON, _ref("Status")), errors=(503,)),
    Operation("get", "/openapi.json", "openapi", "This document", None,
              (200, JSON, {"type": "object"})),
    Operation("get", "/", "dashboard", "The dashboard page", None,
              (200, "text/html", STRING), errors=(404,)),
)  # fmt: skip

ERROR_TEXT = {
    400: "The request is malformed (`bad_request`) or the job spec is invalid (`invalid_spec`, "
    "the message names the field).",
    401: "No token, or an unknown one (`unauthorized`).",
    403: "A read-only token on a route that changes state (`forbidden`).",
    404: "No such job or device (`not_found`).",
    409: "The change contradicts the job's state (`conflict`).",
    413: "The body is too large (`payload_too_large`).",
    503: "Not ready: starting or stopping (`unavailable`).",
}


def _responses(op: Operation) -> dict[str, Any]:
    status, media, schema = op.ok
    out: dict[str, Any] = {
        str(status): {"description": "OK", "content": {media: {"schema": schema}}}
    }
    errors = set(op.errors)
    if op.scope is not None:
        errors.add(401)
    if op.scope is Scope.OPERATOR:
        errors.add(403)
    for code in sorted(errors):
        out[str(code)] = {
            "description": ERROR_TEXT[code],
            "content": {JSON: {"schema": _ref("Error")}},
        }
    out["default"] = {
        "description": "Any other error, with a stable code.",
        "content": {JSON: {"schema": _ref("Error")}},
    }
    return out


def _operation(op: Operation) -> dict[str, Any]:
    out: dict[str, Any] = {
        "operationId": op.operation_id,
        "summary": op.summary,
        "security": [] if op.scope is None else [{"bearer": []}],
        "responses": _responses(op),
    }
    if op.scope is Scope.OPERATOR:
        out["description"] = "Needs the operator token; a read token gets 403."
    if op.params:
        out["parameters"] = list(op.params)
    if op.body:
        spec = {"schema": {"type": "string"}}
        out["requestBody"] = {
            "required": True,
            "description": "A job spec or an experiment file (its `[[jobs]]`), as TOML.",
            "content": {"application/toml": spec, "text/plain": spec},
        }
    return out


def document() -> dict[str, Any]:
    """The whole OpenAPI 3.1 document (a fresh dict each call)."""
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = copy.deepcopy(_operation(op))
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Flotilla federation server",
            "version": __version__,
            "description": "Jobs, rounds, devices and volunteer runs of a running federation, "
            'as JSON; errors are `{"error": {"code", "message"}}`.',
        },
        "paths": paths,
        "components": {
            "schemas": copy.deepcopy(SCHEMAS),
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "The operator token (STATE_DIR/operator.token), or a read "
                    "token from `flotilla server token create --read-only`.",
                }
            },
        },
    }
