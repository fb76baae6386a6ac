"""Job specs from bytes: the operator API's submit body (job file TOML, through
``routes.spec_from_body``, ``core.jobfile`` and ``JobSpec.from_dict``) and the gRPC
``SubmitJob`` request's ``spec_json`` (``JobSpec.from_json``, what ``Jobs.submit_job``
reads)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

import flotilla
from flotilla.core.errors import SpecError, WireError
from flotilla.core.spec import JobSpec
from flotilla.server.http.routes import spec_from_body
from tests.fuzz.harness import Target, fuzz, mutate, mutated, recipes
from tests.fuzz.json_inputs import HOSTILE, json_inputs

pytestmark = [pytest.mark.fuzz, pytest.mark.xdist_group("fuzz"), pytest.mark.timeout(300)]

#: The example job file without its comments: the same tables at a third of the parse cost.
_DIGITS = b"\n".join(
    line.split(b"#")[0].rstrip()
    for line in (Path(flotilla.__file__).parent / "examples" / "digits.toml")
    .read_bytes()
    .split(b"\n")
    if line.split(b"#")[0].strip()
)
TOML_SEEDS = (
    _DIGITS,
    _DIGITS + b'\n[[jobs]]\njob = { name = "a", seed = 1 }\n[[jobs]]\njob = { name = "b" }\n',
    b'[job]\nname = "x"\ntask = "a.b:C"\n[compression]\nuplink = "topk"\n'
    b"uplink_params = { fraction = 0.1 }\n[privacy]\nsecure_aggregation = true\n",
)
#: TOML a parser must refuse without recursing or converting forever.
HOSTILE_TOML = (
    b"a = " + b"[" * 50_000,
    b"a = " + b"{b = " * 50_000,
    b"[job]\nseed = " + b"9" * 5000 + b"\n",
    b"[job]\nrounds = 1e999\n",
    b"[" + b"a." * 20_000 + b"b]\n",
)
_LINES = (
    b"rounds = -1", b"seed = 99999999999999999999999", b"clients_per_round = 0",
    b'uplink = "nope"', b"learning_rate = nan", b"learning_rate = inf", b"alpha = 1e400",
    b"[eligibility]", b"[privacy]", b"neighbours = 0", b"threshold = 1000",
    b"params = { x = [1, [2, [3]]] }", b'name = ""', b"[[jobs]]", b"job = 3",
    b"min_quorum = 99", b'task = "nocolon"', b"over_selection = 0.5",
)  # fmt: skip


def _toml_edit(message: bytes, rng: random.Random) -> bytes:
    """A valid job file with lines dropped, or lines that break a rule put in."""
    lines = message.split(b"\n")
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(lines) + 1)
        if rng.random() < 0.3 and at < len(lines):
            del lines[at]
        else:
            lines.insert(at, rng.choice(_LINES))
    out = b"\n".join(lines)
    return mutate(out, rng) if rng.random() < 0.3 else out


def submit_body(data: bytes) -> None:
    try:
        spec_from_body(data, None)
    except SpecError as exc:
        if "pick one ?job=NAME" not in str(exc):
            raise
        spec_from_body(data, "a")


TOML = Target("jobspec-toml", submit_body, (SpecError, WireError))


def test_job_file_bodies_parse_or_raise_our_errors() -> None:
    inputs = mutated(TOML_SEEDS) | recipes(TOML_SEEDS, _toml_edit) | recipes(TOML_SEEDS, _toml_edit)
    fuzz(TOML, inputs, regressions=TOML_SEEDS + HOSTILE_TOML)


JSON_SEEDS = (
    spec_from_body(TOML_SEEDS[0], None).to_json().encode(),
    spec_from_body(TOML_SEEDS[1], "a").to_json().encode(),
    spec_from_body(TOML_SEEDS[2], None).to_json().encode(),
    json.dumps({"job": {"name": "x", "task": "a.b:C"}}).encode(),
)


def spec_json(data: bytes) -> None:
    JobSpec.from_json(data.decode("utf-8", "replace"), "submitted spec")


SPEC_JSON = Target("jobspec-json", spec_json, (SpecError,))


def test_spec_json_parses_or_raises_our_errors() -> None:
    fuzz(SPEC_JSON, json_inputs(JSON_SEEDS), regressions=JSON_SEEDS + HOSTILE)
