"""The OpenAPI document is valid OpenAPI 3.1, names exactly the routes the server has, and
a property-based run (schemathesis) against the live server, with no token, a read token
and the operator token, finds no 5xx and no answer the document does not allow."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from openapi_spec_validator import OpenAPIV31SpecValidator, validate

from flotilla.server.http.openapi import document
from tests.support.http_server import http_server, quick_toml

pytestmark = pytest.mark.timeout(120)

#: Examples per operation and token: enough to cover each route's parameters and bodies,
#: few enough for the whole run to take seconds.
EXAMPLES = 12
#: Streams forever: its answer's status and type are checked by test_live_feed.py.
ENDLESS = ("/api/v1/events",)


def test_the_document_is_valid_openapi_3_1() -> None:
    doc = document()
    validate(doc, cls=OpenAPIV31SpecValidator)
    assert doc["openapi"].startswith("3.1")
    assert document() == doc and document() is not doc  # fresh, and the same every time


async def test_the_document_names_every_route_the_server_has(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'state' / 'flotilla.db'}"
    async with http_server(tmp_path / "state", db) as s:
        served = set()
        edge = s.server.http_edge
        assert edge is not None
        for resource in edge.app.router.resources():
            info = resource.get_info()
            path = info.get("path") or info.get("formatter")
            if not path or "prefix" in info:  # the static files' directory
                continue
            for route in resource:
                if route.method != "HEAD":
                    served.add((route.method.lower(), path))
    documented = {(m, p) for p, ops in document()["paths"].items() for m in ops}
    assert served == documented


def _run(base: str, token: str | None) -> list[str]:
    """Every operation's cases, called and checked; in a worker thread (schemathesis calls
    with ``requests``, the server runs on the test's event loop)."""
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    schema = schemathesis.openapi.from_dict(document())
    ran = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path in ENDLESS:
            continue

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def check(case: Any) -> None:
            case.call_and_validate(base_url=base, headers=headers, checks=checks, timeout=20)

        check()
        ran.append(operation.label)
    return ran


@pytest.mark.parametrize("who", ["none", "read", "operator"])
async def test_schemathesis_finds_no_5xx_and_no_answer_outside_the_document(
    who: str, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path / 'state' / 'flotilla.db'}"
    async with http_server(tmp_path / "state", db) as s:
        status, _ = await s.submit_toml(quick_toml())  # a job for the routes to show
        assert status == 201
        token = {"none": None, "read": s.read_token, "operator": s.operator_token}[who]
        ran = await asyncio.to_thread(_run, s.base, token)
    assert len(ran) == sum(len(ops) for ops in document()["paths"].values()) - len(ENDLESS)
