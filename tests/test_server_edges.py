"""The server's shape: a transport-free core, a gRPC edge that maps errors in one table.

What a client relies on here: every error the core raises on purpose reaches it as the
status code (and message) it matches on, whether the call is unary or streaming; and the
core stays importable by a second edge without grpc, protobuf or the hosted peers.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from flotilla.cli.remote import _ERRORS as CLIENT_ERRORS
from flotilla.core import errors
from flotilla.proto import flotilla_pb2 as pb
from flotilla.server.grpc.status import STATUS, Refusal, guarded, status_of
from tests.support.live_grpc import LiveServer, live_server, refused

SERVER = Path(__file__).resolve().parent.parent / "flotilla" / "server"


class Aborted(Exception):
    """What grpc.aio's ``context.abort`` raises, so the handler stops there."""


class FakeContext:
    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.status = (code, details)
        raise Aborted(details)


def _flotilla_errors() -> list[type[errors.FlotillaError]]:
    return [
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, errors.FlotillaError)
    ]


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (errors.AuthError, grpc.StatusCode.UNAUTHENTICATED),
        (errors.NotFoundError, grpc.StatusCode.NOT_FOUND),
        (errors.SpecError, grpc.StatusCode.INVALID_ARGUMENT),
        (errors.WireError, grpc.StatusCode.INVALID_ARGUMENT),
        (errors.IntegrityError, grpc.StatusCode.INVALID_ARGUMENT),
        (errors.UpdateRejected, grpc.StatusCode.INVALID_ARGUMENT),
        (errors.StaleRoundError, grpc.StatusCode.FAILED_PRECONDITION),
        (errors.JobStateError, grpc.StatusCode.FAILED_PRECONDITION),
        (errors.BudgetExhausted, grpc.StatusCode.FAILED_PRECONDITION),
        (errors.FlotillaError, grpc.StatusCode.FAILED_PRECONDITION),
        # A database restarting or a full disk: the agent backs off and tries again.
        (errors.StorageUnavailable, grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_each_error_reaches_clients_as_the_status_they_match_on(
    error: type[errors.FlotillaError], code: grpc.StatusCode
) -> None:
    assert status_of(error("why")) == code


def test_every_flotilla_error_has_a_status_and_bugs_have_none() -> None:
    assert all(status_of(cls("x")) is not None for cls in _flotilla_errors())
    assert status_of(ValueError("a bug")) is None


def test_the_operator_client_reads_back_the_class_the_server_sent() -> None:
    for code, cls in CLIENT_ERRORS.items():
        assert status_of(cls("x")) == code, cls
    assert set(STATUS) <= {*_flotilla_errors()}


class Servicer:
    async def Unary(self, request: str, context: Any) -> str:
        if request == "missing":
            raise errors.NotFoundError("unknown job 'j'")
        if request == "bug":
            raise ValueError("a bug")
        return request.upper()

    async def Stream(self, request: str, context: Any) -> AsyncIterator[str]:
        yield "first"
        if request == "stale":
            raise errors.StaleRoundError("stale round: closed")
        raise Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "download stalled for 15s")

    def _private(self) -> None:  # never exposed as a handler
        pass


def test_guarded_handlers_abort_with_the_mapped_status_and_the_errors_message() -> None:
    async def go() -> None:
        servicer: Any = guarded(Servicer())
        ok = FakeContext()
        assert await servicer.Unary("a", ok) == "A" and ok.status is None
        ctx = FakeContext()
        with pytest.raises(Aborted):
            await servicer.Unary("missing", ctx)
        assert ctx.status == (grpc.StatusCode.NOT_FOUND, "unknown job 'j'")
        with pytest.raises(ValueError, match="a bug"):  # a bug stays a bug (UNKNOWN)
            await servicer.Unary("bug", FakeContext())
        for request, status in [
            ("stale", (grpc.StatusCode.FAILED_PRECONDITION, "stale round: closed")),
            ("slow", (grpc.StatusCode.DEADLINE_EXCEEDED, "download stalled for 15s")),
        ]:
            ctx, got = FakeContext(), []
            with pytest.raises(Aborted):
                async for item in servicer.Stream(request, ctx):
                    got.append(item)
            assert got == ["first"] and ctx.status == status
        with pytest.raises(AttributeError):
            servicer._private  # noqa: B018

    asyncio.run(asyncio.wait_for(go(), 10))


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (inside functions too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _offenders(folder: Path, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{path.relative_to(SERVER)}: {module}"
        for path in folder.rglob("*.py")
        for module in _imports(path)
        if any(module == f or module.startswith(f + ".") for f in forbidden)
    )


def test_the_core_imports_no_transport_edge_or_hosted_peer() -> None:
    forbidden = (
        "grpc", "flotilla.proto", "flotilla.server.grpc", "flotilla.server.hosting",
        "flotilla.server.app", "flotilla.p2p", "hivemind", "flotilla.cli",
    )  # fmt: skip
    assert _offenders(SERVER / "federation", forbidden) == []


def test_the_edges_and_hosting_never_reach_back_into_the_composition_root() -> None:
    forbidden = ("flotilla.server.app", "flotilla.p2p", "hivemind", "flotilla.cli")
    assert _offenders(SERVER / "grpc", (*forbidden, "flotilla.server.hosting")) == []
    assert _offenders(SERVER / "hosting", (*forbidden, "flotilla.server.grpc")) == []


def test_nothing_in_the_server_imports_p2p_or_the_cli() -> None:
    assert _offenders(SERVER, ("flotilla.p2p", "hivemind", "flotilla.cli")) == []


# --- the same codes and messages over a real gRPC server ------------------------------


@pytest.fixture
async def live(tmp_path: Path) -> AsyncIterator[LiveServer]:
    async with live_server(tmp_path / "state", speed_test_max_bytes=4096) as srv:
        yield srv


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


@pytest.mark.timeout(120)
async def test_refusals_only_the_edge_makes_and_unknown_jobs_keep_their_codes(
    live: LiveServer,
) -> None:
    device = await live.enrol()
    chunks = [pb.SpeedChunk(data=bytes(1024))] * 5  # one KiB past the limit
    await refused(
        live.stream_call(live.sync_agent.SpeedTest, chunks, device.md),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "speed test too long",
    )
    fetch = live.agent.FetchModel(
        pb.FetchModelRequest(job_id="j", sha256="0" * 64), metadata=device.md, timeout=10
    )
    await refused(_drain(fetch), grpc.StatusCode.FAILED_PRECONDITION, "not assigned")

    op = live.operator
    missing = pb.GetJobRequest(job_id="job-nope")
    for call in (
        op.GetJob(missing, metadata=live.op_md, timeout=10),
        op.CancelJob(missing, metadata=live.op_md, timeout=10),
        _drain(op.ExportModel(missing, metadata=live.op_md, timeout=10)),
    ):
        await refused(call, grpc.StatusCode.NOT_FOUND, "unknown job 'job-nope'")
    job_id = await live.submit()
    cancelled = await op.CancelJob(pb.GetJobRequest(job_id=job_id), metadata=live.op_md)
    assert cancelled.state == "cancelled"
    again = await op.CancelJob(pb.GetJobRequest(job_id=job_id), metadata=live.op_md, timeout=10)
    assert again.state == "cancelled", "cancelling twice is no error"
    devices = await op.ListDevices(pb.ListDevicesRequest(), metadata=live.op_md, timeout=10)
    (listed,) = devices.devices
    assert listed.id == device.device_id and listed.state == "offline", listed
