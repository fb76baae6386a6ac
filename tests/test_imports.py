"""Import hygiene: light installs stay light, layers stay apart, every export exists."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

SUBPACKAGES = [
    "core", "compression", "aggregation", "scheduling", "engine", "client", "tasks", "server",
    "proto", "simulation",
]  # fmt: skip


HEAVY_CHECKS = {
    "flotilla.client": ("sqlalchemy", "hivemind", "aiohttp", "flotilla.server"),
    "flotilla.core": ("torch", "grpc", "sqlalchemy", "aiohttp", "hivemind"),
    "flotilla.tasks": ("torch", "sklearn"),
    "flotilla.cli.remote": ("sqlalchemy", "aiohttp", "torch", "flotilla.server"),
    "flotilla.cli": ("grpc", "sqlalchemy", "torch", "flotilla.server", "flotilla.simulation"),
    # The server's core knows no transport and no hosted peer; the server never loads p2p.
    "flotilla.server.federation.facade": (
        "grpc", "flotilla.proto", "flotilla.server.grpc", "flotilla.server.hosting",
        "flotilla.p2p", "hivemind",
    ),
    "flotilla.server.app": ("flotilla.p2p", "hivemind", "flotilla.cli"),
    "flotilla.engine": ("flotilla.server", "flotilla.client", "torch", "sqlalchemy", "grpc"),
    "flotilla.aggregation": ("flotilla.server", "flotilla.client", "torch", "grpc"),
    "flotilla.scheduling": ("flotilla.server", "flotilla.client", "torch", "grpc"),
    "flotilla.simulation": (
        "flotilla.server", "torch", "sqlalchemy", "aiohttp", "ray", "matplotlib", "sklearn",
    ),
    "flotilla.compression": (
        "flotilla.server", "flotilla.client", "flotilla.aggregation", "torch", "grpc",
        "sqlalchemy",
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def loaded_by() -> dict[str, set[str]]:
    """The modules a fresh interpreter holds after importing each module (run in parallel)."""
    procs = {
        module: subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import json, sys, {module}; print(json.dumps(list(sys.modules)))",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for module in HEAVY_CHECKS
    }
    out: dict[str, set[str]] = {}
    for module, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
        out[module] = set(json.loads(stdout.splitlines()[-1]))
    return out


def _offenders(loaded: set[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden))


@pytest.mark.parametrize("module", list(HEAVY_CHECKS))
def test_importing_loads_nothing_heavy(module: str, loaded_by: dict[str, set[str]]) -> None:
    assert _offenders(loaded_by[module], HEAVY_CHECKS[module]) == []


def test_core_imports_nothing_else_of_flotilla(loaded_by: dict[str, set[str]]) -> None:
    ours = {m for m in loaded_by["flotilla.core"] if m.startswith("flotilla.")}
    assert sorted(m for m in ours if not m.startswith("flotilla.core")) == []


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_every_exported_name_exists(name: str) -> None:
    module = importlib.import_module(f"flotilla.{name}")
    exported = module.__all__
    assert len(exported) == len(set(exported)), "duplicates in __all__"
    missing = [attr for attr in exported if getattr(module, attr, None) is None]
    assert missing == []
