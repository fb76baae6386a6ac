"""The checked-in protobuf modules are exactly what ``flotilla.proto.generate`` makes today."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("grpc_tools")

import flotilla.proto
from flotilla.proto.generate import generate

CHECKED_IN = Path(flotilla.proto.__file__).resolve().parent
GENERATED = ("flotilla_pb2.py", "flotilla_pb2.pyi", "flotilla_pb2_grpc.py")


def test_generated_modules_are_current(tmp_path: Path) -> None:
    out = tmp_path / "fresh" / "out"  # does not exist yet: generate must create it
    written = generate(out)
    assert sorted(p.name for p in written) == sorted(GENERATED)
    for path in written:
        assert path.parent == out / "flotilla" / "proto"
        stale = path.read_bytes() != (CHECKED_IN / path.name).read_bytes()
        assert not stale, f"{path.name} is stale: run `python -m flotilla.proto.generate`"


def test_nothing_else_is_generated(tmp_path: Path) -> None:
    generate(tmp_path)
    made = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert made == sorted(f"flotilla/proto/{name}" for name in GENERATED)
