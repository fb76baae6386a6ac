"""What the fuzz harnesses found, one plain test per fix (they run without the ``fuzz``
marker's long share): each input once made a decoder raise an error outside our tree."""

from __future__ import annotations

import json

import pytest

from flotilla.core.conditions import DeviceConditions
from flotilla.core.errors import SpecError, WireError
from flotilla.core.spec import JobSpec, parse_toml
from flotilla.server.http import device_wire
from flotilla.server.http.routes import spec_from_body

_DEEP_JSON = b"[" * 100_000
_HUGE = 10**400


@pytest.mark.parametrize("body", [_DEEP_JSON, b'{"a":' * 50_000, b"1" * 5000])
def test_device_json_too_deep_or_too_long_is_a_wire_error(body: bytes) -> None:
    # Was RecursionError (nesting) or ValueError (int past 4300 digits): a 500.
    with pytest.raises(WireError, match="not valid UTF-8 JSON"):
        device_wire.loads(body, "poll request")


def test_device_numbers_past_float_range_are_wire_errors() -> None:
    # Was OverflowError from math.isfinite / float() on a JSON int like 10**400.
    profile = {"tasks": ["a.b:C"], "gflops": _HUGE}
    with pytest.raises(WireError, match="'gflops' must be finite"):
        device_wire.poll_request({"profile": profile})
    upload = {"job_id": "j", "round": 1, "round_token": "t", "num_samples": 1, "size": 1,
              "sha256": "0" * 64, "metrics": {"loss": _HUGE}}  # fmt: skip
    with pytest.raises(WireError, match="'loss' must be finite"):
        device_wire.upload_request(upload)


def test_battery_past_float_range_is_a_wire_error() -> None:
    with pytest.raises(WireError, match=r"battery must be within 0\.\.1"):
        DeviceConditions.from_dict({"battery": _HUGE})
    assert DeviceConditions.from_dict({"battery": 1}).battery == 1.0


@pytest.mark.parametrize("text", ["a = " + "[" * 50_000, "[job]\nseed = " + "9" * 5000])
def test_toml_too_deep_or_too_long_is_a_spec_error(text: str) -> None:
    # Was RecursionError (tomllib recurses per nesting) or ValueError (int() of 5000 digits).
    with pytest.raises(SpecError, match="not valid TOML"):
        parse_toml(text, "request body")


@pytest.mark.parametrize("text", [_DEEP_JSON.decode(), "1" * 5000])
def test_spec_json_too_deep_or_too_long_is_a_spec_error(text: str) -> None:
    with pytest.raises(SpecError, match="not valid JSON"):
        JobSpec.from_json(text, "submitted spec")


def test_float_field_past_float_range_is_a_spec_error() -> None:
    # Was OverflowError from float() in build_dataclass, through JSON or TOML alike.
    spec = {"job": {"name": "x", "task": "a.b:C"}, "train": {"learning_rate": _HUGE}}
    with pytest.raises(SpecError, match=r"'train\.learning_rate' is out of range"):
        JobSpec.from_json(json.dumps(spec), "submitted spec")
    body = b'[job]\nname = "x"\ntask = "a.b:C"\n[train]\nlearning_rate = 1' + b"0" * 400
    with pytest.raises(SpecError, match="out of range"):
        spec_from_body(body, None)
