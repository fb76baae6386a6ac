"""The architecture as tests: no import circles, no reading another object's privates, and
the layer contracts of docs/architecture.md (``[tool.importlinter]``, ``make lint``) hold.

The import graph is read with ``ast``, so it sees every import statement: module level,
inside functions (lazy) and under ``if TYPE_CHECKING:``. Type-checking imports count: a
module whose annotations name another module changes when that one does, and the circles
the review found (``server/app.py`` <-> ``agent_service.py``, ``engine/rounds.py`` <->
``p2p_round.py``) run through them.
"""

from __future__ import annotations

import ast
import itertools
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from tests.support.lifetime import bound

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "flotilla"

pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True, slots=True)
class Edge:
    """One import statement from one of our modules to another."""

    importer: str
    imported: str
    where: str  # path:line
    kind: str  # "top", "lazy" (inside a function) or "type-checking"

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported}  ({self.where}, {self.kind})"


def _is_generated(path: Path) -> bool:
    return path.name.endswith(("_pb2.py", "_pb2_grpc.py"))


@cache
def modules() -> Mapping[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    out: dict[str, Path] = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement with where it runs: at import, in a function, or never."""

    def walk(node: ast.AST, kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, kind
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, "type-checking" if kind == "type-checking" else "lazy")
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), "type-checking")
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), kind)
            else:
                yield from walk(child, kind)

    yield from walk(tree, "top")


def _resolve(name: str, known: Mapping[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of our modules."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def _targets(node: ast.Import | ast.ImportFrom, module: str, path: Path) -> Iterator[str]:
    known = modules()
    if isinstance(node, ast.Import):
        for alias in node.names:
            if (target := _resolve(alias.name, known)) is not None:
                yield target
        return
    if node.level:
        package = module.split(".")
        if path.name != "__init__.py":
            package = package[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, *([node.module] if node.module else [])])
    else:
        base = node.module or ""
    for alias in node.names:
        # `from pkg import submodule` imports the submodule; `from mod import name` the module.
        target = _resolve(f"{base}.{alias.name}", known) if alias.name != "*" else None
        if target is None or target == _resolve(base, known) or target == base:
            target = _resolve(base, known)
        if target is not None:
            yield target


@cache
def edges() -> tuple[Edge, ...]:
    out: list[Edge] = []
    for module, path in modules().items():
        tree = ast.parse(path.read_text(), str(path))
        for node, kind in _imports(tree):
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            for target in _targets(node, module, path):
                if target != module:
                    out.append(Edge(module, target, where, kind))
    return tuple(dict.fromkeys(out))  # `from m import a, b` is one edge


def subpackage(module: str) -> str:
    """``flotilla.engine.rounds`` -> ``engine``; top-level modules (``cli``) are their own."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _strongly_connected(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Tarjan's components with more than one member (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, ())))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _cycle_through(start: str, graph: Mapping[str, set[str]], within: set[str]) -> list[str]:
    """A shortest circle from ``start`` back to itself inside one component (BFS)."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for succ in sorted(graph.get(node, ())):
                if succ not in within:
                    continue
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if succ not in parents:
                    parents[succ] = node
                    nxt.append(succ)
        frontier = nxt
    return [start]


def _describe(
    components: list[list[str]], graph: Mapping[str, set[str]], key: Callable[[str], str]
) -> str:
    lines = []
    by_pair: dict[tuple[str, str], list[Edge]] = defaultdict(list)
    for edge in edges():
        by_pair[key(edge.importer), key(edge.imported)].append(edge)
    for component in components:
        lines.append(f"circle among {', '.join(component)}:")
        shown: set[str] = set()
        for member in component:  # one shortest circle through each member not yet shown
            if member in shown:
                continue
            cycle = _cycle_through(member, graph, set(component))
            shown.update(cycle)
            lines.append("  " + " -> ".join(cycle))
            for a, b in itertools.pairwise(cycle):
                lines.extend(f"      {edge}" for edge in by_pair[a, b][:3])
    return "\n".join(lines)


def _graph(key: Callable[[str], str]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for edge in edges():
        a, b = key(edge.importer), key(edge.imported)
        if a != b:
            graph[a].add(b)
    return graph


def test_circles_are_found_with_a_path_through_them() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}}
    assert _strongly_connected(graph) == [["a", "b", "c"]]
    assert _cycle_through("b", graph, {"a", "b", "c"}) == ["b", "c", "a", "b"]
    assert _strongly_connected({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_sees_lazy_and_type_checking_imports() -> None:
    """The reader must see what import-time checks cannot, or the next two tests prove little."""
    kinds = {edge.kind for edge in edges()}
    assert kinds == {"top", "lazy", "type-checking"}
    assert any(e.imported.startswith("flotilla.server.") for e in edges() if e.kind == "lazy")
    assert len({e.importer for e in edges()}) > 50


def test_no_import_circle_between_modules() -> None:
    graph = _graph(lambda m: m)
    circles = _strongly_connected(graph)
    assert not circles, "\n" + _describe(circles, graph, lambda m: m)


def test_no_import_circle_between_subpackages() -> None:
    graph = _graph(subpackage)
    circles = _strongly_connected(graph)
    assert not circles, "\n" + _describe(circles, graph, subpackage)


def test_the_agent_imports_p2p_only_inside_functions() -> None:
    """docs/architecture.md: the agent imports p2p (and so hivemind) only when a server-less
    round arrives; import-linter cannot tell a lazy import from a module-level one."""
    eager = [
        str(e)
        for e in edges()
        if subpackage(e.importer) == "client" and subpackage(e.imported) == "p2p"
        if e.kind != "lazy"
    ]
    assert eager == []


# --- private attributes --------------------------------------------------------------------

#: Attributes whose leading underscore is part of a public API, not a privacy marker.
PUBLIC_UNDERSCORE = {
    "_replace",  # NamedTuple's documented API (also _asdict, _fields, _make)
    "_asdict",
    "_fields",
    "_make",
    "_exit",  # os._exit: documented; a child that must not run atexit handlers
}

#: (path, expression) pairs allowed to read a private attribute, each with the reason. Most
#: are hivemind's internals in the p2p adapter: hivemind is pinned (``==1.1.12``, pyproject)
#: and offers no public hook for these, and p2p/ is the one place that may know it.
ALLOWED_PRIVATE: dict[tuple[str, str], str] = {
    ("flotilla/mobile/runtime.py", "runtime._load_for_executorch_for_training_from_buffer"): (
        "ExecuTorch's (experimental) training loader: in executorch.extension.training's "
        "__all__, its only loader; executorch is pinned (==1.5.1) and runtime.py its one user"
    ),
    ("flotilla/p2p/averaging.py", "super()._register_allreduce_group"): (
        "a round's verdict group is registered beside hivemind's own; no public hook"
    ),
    ("flotilla/p2p/averaging.py", "super()._run_allreduce_inplace_"): (
        "a verdict round is hivemind's all-reduce run on given tensors; no public entry"
    ),
    ("flotilla/p2p/averaging.py", "super()._aggregate_with_group"): (
        "timing a round and checking its members wraps hivemind's group step (two sites)"
    ),
    ("flotilla/p2p/averaging.py", "super()._communicate_with_peer"): (
        "remote parts go through hivemind's per-peer exchange; only the local part differs"
    ),
    ("flotilla/p2p/averaging.py", "super()._step"): (
        "the commit gate must know which step a round serves; hivemind runs each step as "
        "this coroutine in its averaging process, with no public hook"
    ),
    ("flotilla/p2p/averaging.py", "super()._apply"): (
        "SafeAverager gates CompleteRounds' own commit (a method of ours, one class up)"
    ),
    ("flotilla/p2p/averaging.py", "step._uid"): (
        "a step's only identity both processes share is its future's id; StepControl has "
        "no public one"
    ),
    ("flotilla/p2p/swarm.py", "super()._average_gradients_and_load_into_optimizer"): (
        "hivemind.Optimizer falls back to local gradients silently; counting averaged epochs "
        "wraps the one step that averages"
    ),
    ("flotilla/p2p/codecs.py", "serialization._BASE_COMPRESSION_TYPES"): (
        "hivemind decodes by wire type from this module table and has no registration hook; "
        "its int8 decoder fails under NumPy 2, so flotilla's replaces it"
    ),
}


def _is_private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__") and attr != "_"


def _strings(node: ast.expr) -> set[str]:
    return {
        c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)
    }


def _defined_privates(tree: ast.Module) -> set[str]:
    """The private names a module defines: module- and class-level functions, classes and
    names (dataclass fields included), ``__slots__``, and ``self._x``/``cls._x``
    assignments. A leading underscore means private to the defining module, as in Python's
    own convention, so a module may read these on any object: ``other._x`` in ``__eq__``,
    a classmethod filling ``cls()``'s fields, a friend class in the same file."""
    names: set[str] = set()
    bodies: list[list[ast.stmt]] = [tree.body]
    while bodies:
        for stmt in bodies.pop():
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(stmt.name)
                if isinstance(stmt, ast.ClassDef):
                    bodies.append(stmt.body)
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        names.add(target.id)
                        if target.id == "__slots__" and stmt.value is not None:
                            names.update(_strings(stmt.value))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
    return {name for name in names if _is_private(name)}


def _private_access(node: ast.AST) -> tuple[ast.expr, str] | None:
    """(object, name) of ``obj._name`` or ``getattr/hasattr/setattr(obj, "_name", ...)``."""
    if isinstance(node, ast.Attribute) and _is_private(node.attr):
        return node.value, node.attr
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr", "setattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
        and _is_private(node.args[1].value)
    ):
        return node.args[0], node.args[1].value
    return None


def _is_super(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def _private_reads_in(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, expression) of every ``obj._name`` (or ``getattr(obj, "_name")``) where ``obj``
    is not ``self`` or ``cls`` and ``_name`` is not defined by this module."""
    own = _defined_privates(tree)
    for node in ast.walk(tree):
        if (access := _private_access(node)) is None:
            continue
        obj, name = access
        if name in PUBLIC_UNDERSCORE:
            continue
        # super()._x reaches the base class's private, which is seldom ours: always listed.
        if name in own and not _is_super(obj):
            continue
        if isinstance(obj, ast.Name) and obj.id in ("self", "cls"):
            continue
        yield obj.lineno, ast.unparse(node)


@cache
def private_reads() -> tuple[tuple[str, int, str], ...]:
    """(path, line, expression) of every private read in the package."""
    out: list[tuple[str, int, str]] = []
    for path in modules().values():
        if _is_generated(path):
            continue  # written by protoc, not by us
        tree = ast.parse(path.read_text(), str(path))
        rel = str(path.relative_to(ROOT))
        out.extend((rel, line, expr) for line, expr in _private_reads_in(tree))
    return tuple(sorted(out))


def test_the_private_reader_tells_own_privates_from_anothers() -> None:
    source = """
class Runner:
    __slots__ = ("_slot",)
    def __init__(self): self._task = 1
    def __eq__(self, other): return self._task == other._task and other._slot
    def _helper(self): return super()._helper()

def mode(runner, pool):
    getattr(pool, "_claimed")
    return runner._aggregator, Runner._helper, pool._replace(x=1), runner.__dict__
"""
    found = sorted(expr for _, expr in _private_reads_in(ast.parse(source)))
    assert found == ["getattr(pool, '_claimed')", "runner._aggregator", "super()._helper"]


def test_no_module_reads_another_objects_private_attributes() -> None:
    violations = [
        f"{path}:{line}: {expr}"
        for path, line, expr in private_reads()
        if (path, expr) not in ALLOWED_PRIVATE
    ]
    assert not violations, "\n" + "\n".join(violations)


def test_every_allowed_private_read_still_exists() -> None:
    """A stale allow-list entry would quietly permit the next such read."""
    present = {(path, expr) for path, _, expr in private_reads()}
    assert sorted(set(ALLOWED_PRIVATE) - present) == []


# --- import-linter -------------------------------------------------------------------------


def _lint_imports() -> list[str]:
    script = Path(sys.executable).with_name("lint-imports")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()"]


def _run_lint_imports(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """lint-imports over the tree at ``root`` (it reads ``root``/pyproject.toml)."""
    return subprocess.run(
        bound([*_lint_imports(), "--no-cache", *args]),
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=100,
    )


def test_the_layer_contracts_hold() -> None:
    """``make lint`` runs the same check; here a broken layer rule also fails pytest."""
    proc = _run_lint_imports(ROOT)
    assert "Analyzed" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr


@dataclass(frozen=True, slots=True)
class Probe:
    """One import that breaks one rule, planted in a copy of the tree."""

    contract: str  # the contract's id in [tool.importlinter]
    file: str  # under flotilla/
    target: str
    kind: str = "lazy"  # or "type-checking"

    @property
    def importer(self) -> str:
        parts = Path(PACKAGE, self.file).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    def source(self, n: int) -> str:
        if self.kind == "lazy":
            return f"\n\ndef _probe_{n}() -> None:\n    import {self.target}\n"
        return f"\n\nimport typing as _t{n}\n\nif _t{n}.TYPE_CHECKING:\n    import {self.target}\n"


#: Every dependency rule of docs/architecture.md, broken once each by a lazy import (one by
#: a type-checking one): `make lint` must name the planted import under the rule's contract.
PROBES = (
    Probe("core", "core/__init__.py", "flotilla.compression"),
    Probe("core", "core/__init__.py", "torch"),
    Probe("core", "core/__init__.py", "sqlalchemy"),
    Probe("core", "core/__init__.py", "grpc"),
    Probe("core", "core/__init__.py", "hivemind"),
    Probe("proto", "proto/__init__.py", "flotilla.engine"),
    Probe("compression", "compression/__init__.py", "flotilla.aggregation"),
    Probe("aggregation", "aggregation/__init__.py", "flotilla.compression"),
    Probe("scheduling", "scheduling/__init__.py", "flotilla.engine"),
    Probe("engine", "engine/__init__.py", "flotilla.tasks"),
    Probe("engine", "engine/__init__.py", "flotilla.proto"),
    Probe("engine", "engine/__init__.py", "flotilla.server", kind="type-checking"),
    Probe("tasks", "tasks/__init__.py", "flotilla.compression"),
    Probe("client", "client/__init__.py", "flotilla.tasks"),
    Probe("client", "client/__init__.py", "flotilla.server"),
    Probe("client", "client/__init__.py", "flotilla.engine"),
    Probe("p2p", "p2p/__init__.py", "flotilla.client"),
    Probe("p2p", "p2p/__init__.py", "flotilla.engine"),
    Probe("server", "server/__init__.py", "flotilla.client"),
    Probe("server", "server/__init__.py", "flotilla.p2p"),
    Probe("server", "server/__init__.py", "flotilla.simulation"),
    Probe("server-edge", "server/federation/__init__.py", "flotilla.server.grpc"),
    Probe("server-core", "server/federation/__init__.py", "flotilla.proto"),
    Probe("server-core", "server/federation/__init__.py", "grpc"),
    Probe("simulation", "simulation/__init__.py", "flotilla.server"),
    Probe("simulation", "simulation/__init__.py", "flotilla.client"),
    Probe("simulation", "simulation/__init__.py", "grpc"),
    Probe("cli-jobfiles", "cli", "flotilla.simulation.experiment"),
    Probe("layers", "core/__init__.py", "flotilla.engine"),
)


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """A copy of the tree with every probe planted, and lint-imports' report per contract."""
    root = tmp_path_factory.mktemp("planted")
    shutil.copytree(ROOT / PACKAGE, root / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    edge = root / PACKAGE / "server" / "grpc" / "__init__.py"
    if not edge.exists():  # the gRPC edge package, until it is written
        edge.parent.mkdir()
        edge.write_text("")
    for n, probe in enumerate(PROBES):
        path = root / PACKAGE / probe.file
        if probe.file == "cli":  # flotilla/cli.py, or the flotilla/cli/ package
            module = path.with_suffix(".py")
            path = module if module.exists() else path / "__init__.py"
        with path.open("a") as f:
            f.write(probe.source(n))
    # A top-level module no layer names, and two core modules importing each other.
    (root / PACKAGE / "unplaced.py").write_text("")
    (root / PACKAGE / "core" / "probe_a.py").write_text("import flotilla.core.probe_b\n")
    (root / PACKAGE / "core" / "probe_b.py").write_text(
        "def probe() -> None:\n    import flotilla.core.probe_a\n"
    )
    reports: dict[str, str] = {}

    def report(contract: str) -> str:
        if contract not in reports:
            proc = _run_lint_imports(root, "--contract", contract)
            assert "Analyzed" in proc.stdout, proc.stdout + proc.stderr
            reports[contract] = proc.stdout
        return reports[contract]

    return report


@pytest.mark.parametrize("probe", PROBES, ids=lambda p: f"{p.contract}:{p.target}:{p.kind}")
def test_make_lint_names_a_planted_import_under_its_rule(
    probe: Probe, planted: Callable[[str], str]
) -> None:
    assert f"{probe.importer} -> {probe.target} " in planted(probe.contract)


def test_make_lint_wants_every_top_level_module_placed_in_a_layer(
    planted: Callable[[str], str],
) -> None:
    assert "- flotilla.unplaced" in planted("layers")


def test_make_lint_finds_a_circle_through_a_lazy_import(planted: Callable[[str], str]) -> None:
    report = planted("acyclic")
    assert "No cycles are allowed in flotilla.core." in report
    assert ".probe_a -> .probe_b" in report or ".probe_b -> .probe_a" in report
