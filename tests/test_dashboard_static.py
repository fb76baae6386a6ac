"""The dashboard page ships in the package and fetches nothing from the internet: no CDN,
no web font, no script or stylesheet from another host."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.lifetime import bound

ROOT = Path(__file__).resolve().parents[1]
STATIC = ROOT / "flotilla" / "dashboard" / "static"
#: An XML namespace name, never fetched: ``document.createElementNS`` needs it to make SVG.
SVG_NAMESPACE = "http://www.w3.org/2000/svg"
#: Where a URL to somewhere else could hide: a scheme, or a protocol-relative ``//host``.
REMOTE = re.compile(r"(?i)\b(?:https?|wss?|ftp):|[\"'(=]\s*//[a-z0-9]")

pytestmark = pytest.mark.timeout(120)


def static_files() -> list[Path]:
    return sorted(p for p in STATIC.rglob("*") if p.is_file())


def test_the_page_and_its_scripts_are_there() -> None:
    names = {p.name for p in static_files()}
    assert {"index.html", "app.js", "app.css"} <= names, names


@pytest.mark.parametrize("path", static_files(), ids=lambda p: p.name)
def test_no_static_file_points_to_the_internet(path: Path) -> None:
    text = path.read_text()
    found = [
        (n, line.strip())
        for n, line in enumerate(text.splitlines(), 1)
        if REMOTE.search(line.replace(SVG_NAMESPACE, "svg-namespace"))
    ]
    assert not found, f"{path.name} refers to another host: {found}"


def test_the_remote_pattern_catches_what_it_must() -> None:
    for bad in ('<script src="https://cdn.example/x.js">', "@import url(//fonts.example/a);",
                "fetch('http://example.com')", '<link href= "//cdn.example/a.css">'):  # fmt: skip
        assert REMOTE.search(bad), bad
    for fine in ('<script src="/static/app.js">', "// a comment", "a // b"):
        assert not REMOTE.search(fine), fine


def test_scripts_never_parse_markup() -> None:
    """Server strings reach the page as text nodes: no innerHTML, outerHTML, insertAdjacentHTML
    or document.write anywhere."""
    for path in STATIC.glob("*.js"):
        text = path.read_text()
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
            assert sink not in text, f"{path.name} uses {sink}"


def test_a_built_wheel_carries_every_static_file(tmp_path: Path) -> None:
    """What ``pip install flotilla`` gets: a real wheel built from this checkout."""
    src = tmp_path / "src"
    shutil.copytree(
        ROOT / "flotilla", src / "flotilla", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    done = subprocess.run(
        bound([*pip, "-w", str(tmp_path / "dist"), str(src)]),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    [wheel] = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        shipped = set(z.namelist())
    for path in static_files():
        assert path.relative_to(ROOT).as_posix() in shipped, path
