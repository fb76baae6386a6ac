"""The HTTP device edge's JSON bodies: ``device_wire.loads`` and every request parser
(enrol, poll, heartbeat, upload, failure, leave) on the value it returns."""

from __future__ import annotations

import json

import pytest

from flotilla.core.errors import WireError
from flotilla.server.http import device_wire
from tests.fuzz.harness import Target, fuzz
from tests.fuzz.json_inputs import HOSTILE, json_inputs

pytestmark = [pytest.mark.fuzz, pytest.mark.xdist_group("fuzz"), pytest.mark.timeout(300)]

_SHA = "0" * 64
_CONDITIONS = {"charging": True, "battery": 0.8, "network": "wifi", "idle": True}
_PROFILE = {
    "tasks": ["a.b:C"], "gflops": 2.0, "memory_bytes": 1 << 30, "device_class": "phone",
    "samples": {"a.b:C": 120},
}  # fmt: skip
_REF = {"job_id": "job-1", "round": 2, "round_token": "t" * 32}
SEEDS = tuple(
    json.dumps(body).encode()
    for body in (
        {"protocol": 1, "token": "tok", "profile": _PROFILE},
        {"profile": _PROFILE, "conditions": _CONDITIONS},
        {"round_token": "t", "conditions": _CONDITIONS},
        {**_REF, "num_samples": 5, "size": 100, "sha256": _SHA, "codec": "int8",
         "metrics": {"loss": 0.1}},
        {**_REF, "reason": "conditions"},
        {"reason": "bye"},
    )
)  # fmt: skip
PARSERS = (
    device_wire.enrol_request,
    device_wire.poll_request,
    device_wire.heartbeat_request,
    device_wire.upload_request,
    device_wire.failure_request,
    device_wire.leave_request,
)


def parse_body(data: bytes) -> None:
    """``loads`` as the edge calls it, then every parser; refused only when all refuse."""
    value = device_wire.loads(data, "request")
    refused: list[WireError] = []
    for parse in PARSERS:
        try:
            parse(value)
        except WireError as exc:
            refused.append(exc)
    if len(refused) == len(PARSERS):
        raise refused[-1]


TARGET = Target("device-json", parse_body, (WireError,))


def test_device_json_bodies_parse_or_raise_our_errors() -> None:
    fuzz(TARGET, json_inputs(SEEDS), regressions=SEEDS + HOSTILE)
