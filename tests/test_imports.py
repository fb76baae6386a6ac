"""Heavy imports are lazy: what a fresh interpreter holds right after ``import X``.

This sees module-level imports only, so it is the runtime half of the layer rules: light
installs stay light, and a package's ``__init__`` does not drag in its heavy siblings. An
import inside a function is a dependency too; those are checked by import-linter
(``make lint``, ``[tool.importlinter]``) and by tests/test_architecture.py.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

from tests.support.lifetime import bound

SUBPACKAGES = [
    "core", "compression", "aggregation", "scheduling", "engine", "client", "tasks", "server",
    "proto", "simulation", "p2p", "report", "mobile", "mobile.lite",
]  # fmt: skip


HEAVY_CHECKS = {
    "flotilla.client": ("sqlalchemy", "hivemind", "aiohttp", "flotilla.server"),
    "flotilla.core": ("torch", "grpc", "sqlalchemy", "aiohttp", "hivemind"),
    "flotilla.tasks": ("torch", "sklearn"),
    "flotilla.cli.remote": ("sqlalchemy", "aiohttp", "torch", "flotilla.server"),
    # The server's core knows no transport and no hosted peer; the server never loads p2p.
    "flotilla.server.federation.facade": (
        "grpc", "flotilla.proto", "flotilla.server.grpc", "flotilla.server.hosting",
        "flotilla.p2p", "hivemind",
    ),
    "flotilla.server.app": ("flotilla.p2p", "hivemind", "flotilla.cli"),
    # The docs site renders the OpenAPI document without the server's stack.
    "flotilla.server.http.openapi": ("aiohttp", "sqlalchemy", "grpc", "torch"),
    # The HTTP edge sits beside the gRPC edge, never on it.
    "flotilla.server.http.edge": ("grpc", "flotilla.proto", "flotilla.server.grpc"),
    "flotilla.engine": ("flotilla.server", "flotilla.client", "torch", "sqlalchemy", "grpc"),
    "flotilla.aggregation": ("flotilla.server", "flotilla.client", "torch", "grpc"),
    "flotilla.scheduling": ("flotilla.server", "flotilla.client", "torch", "grpc"),
    # Simulated devices run the update pipeline, not the agent: no grpc, no client.agent.
    "flotilla.simulation": (
        "flotilla.server", "flotilla.client.agent", "flotilla.p2p", "torch", "sqlalchemy",
        "aiohttp", "ray", "matplotlib", "sklearn", "grpc", "hivemind",
    ),
    # What simulation and p2p may share with the agent must not load the agent and grpc.
    "flotilla.client.training": (
        "flotilla.client.agent", "flotilla.server", "grpc", "sqlalchemy", "hivemind",
    ),
    # `flotilla --help` and `flotilla job submit` start without the engine or simulator.
    "flotilla.cli": (
        "flotilla.server", "flotilla.simulation", "flotilla.engine", "flotilla.p2p", "torch",
        "grpc", "sqlalchemy", "hivemind",
    ),
    # Bars and charts load tqdm and matplotlib when they draw, not when imported.
    "flotilla.report": ("matplotlib", "tqdm", "torch", "grpc", "flotilla.server"),
    # The lite client's HTTP side runs on the base install: no torch, grpc or server stack.
    "flotilla.mobile.lite.http": (
        "torch", "grpc", "aiohttp", "sqlalchemy", "flotilla.server", "flotilla.client",
        "flotilla.proto",
    ),
    "flotilla.core.jobfile": ("flotilla.simulation", "flotilla.engine", "torch", "grpc"),
    "flotilla.compression": (
        "flotilla.server", "flotilla.client", "flotilla.aggregation", "torch", "grpc",
        "sqlalchemy",
    ),
    # A device reads an exported program's manifest without torch; ExecuTorch is loaded
    # only when a program is exported.
    "flotilla.mobile": ("torch", "executorch", "grpc", "flotilla.tasks"),
    "flotilla.mobile.manifest": ("torch", "executorch", "grpc", "flotilla.tasks"),
    "flotilla.mobile.export": ("executorch", "grpc", "sqlalchemy", "flotilla.server"),
}  # fmt: skip


#: Every module of the package imported, so a module added later is covered too.
PACKAGE_CHECKS = {
    "flotilla.server": (
        "flotilla.client", "flotilla.p2p", "flotilla.simulation", "hivemind", "torch",
    ),
    "flotilla.client": (
        "flotilla.server", "flotilla.simulation", "flotilla.engine", "sqlalchemy", "aiohttp",
        "hivemind",
    ),
    "flotilla.p2p": (
        "flotilla.server", "flotilla.client", "flotilla.engine", "flotilla.simulation",
        "sqlalchemy", "grpc",
    ),
    # The torch-free device: what the base install has (numpy), and nothing of the server.
    "flotilla.mobile.lite": (
        "torch", "grpc", "sklearn", "sqlalchemy", "aiohttp", "hivemind", "safetensors",
        "google.protobuf", "flotilla.server", "flotilla.client", "flotilla.tasks",
        "flotilla.compression", "flotilla.proto", "flotilla.engine",
    ),
}  # fmt: skip

_IMPORT_ALL = """
import importlib, pkgutil
package = importlib.import_module({name!r})
for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    if ".migrations." not in info.name:  # Alembic scripts run only inside Alembic
        importlib.import_module(info.name)
"""


@pytest.fixture(scope="module")
def loaded_by() -> dict[str, set[str]]:
    """The modules a fresh interpreter holds after importing each module, or each package
    with all its modules (run in parallel)."""
    scripts = {module: f"import {module}" for module in HEAVY_CHECKS}
    scripts.update({f"{name}.*": _IMPORT_ALL.format(name=name) for name in PACKAGE_CHECKS})
    procs = {
        key: subprocess.Popen(
            bound(
                [
                    sys.executable,
                    "-c",
                    f"{code}\nimport json, sys\nprint(json.dumps(list(sys.modules)))",
                ]
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for key, code in scripts.items()
    }
    out: dict[str, set[str]] = {}
    for key, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        out[key] = set(json.loads(stdout.splitlines()[-1]))
    return out


def _offenders(loaded: set[str], forbidden: tuple[str, ...]) -> list[str]:
    """The forbidden modules loaded: ours by name, third-party ones by distribution."""
    hits = {m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden)}
    return sorted({m if m.startswith("flotilla.") else m.split(".")[0] for m in hits})


@pytest.mark.parametrize("module", list(HEAVY_CHECKS))
def test_importing_loads_nothing_heavy(module: str, loaded_by: dict[str, set[str]]) -> None:
    assert _offenders(loaded_by[module], HEAVY_CHECKS[module]) == []


@pytest.mark.parametrize("package", list(PACKAGE_CHECKS))
def test_no_module_of_the_package_loads_what_it_must_not(
    package: str, loaded_by: dict[str, set[str]]
) -> None:
    assert _offenders(loaded_by[f"{package}.*"], PACKAGE_CHECKS[package]) == []


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
