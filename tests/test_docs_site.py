"""The docs site builds with ``--strict`` and no network, and its pages fetch nothing remote.

``make docs`` promises a site an operator can build and read offline: every link and
anchor resolves (strict), the build reaches no network (it runs in a network namespace
with no route out when the machine allows one, behind a dead proxy otherwise), and no page
loads a script, stylesheet, font or image from another host. The HTTP API page's route
table comes from the OpenAPI document through ``docs_hooks/openapi_routes.py``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support.lifetime import bound

REPO = Path(__file__).resolve().parents[1]
#: Tag -> attributes that make the browser fetch something as the page loads.
ASSET_ATTRS = {
    "script": ("src",),
    "link": ("href",),
    "img": ("src", "srcset"),
    "iframe": ("src",),
    "source": ("src", "srcset"),
    "video": ("src", "poster"),
    "audio": ("src",),
    "embed": ("src",),
    "object": ("data",),
}
REMOTE = re.compile(r"^\s*(https?:)?//", re.IGNORECASE)
CSS_REMOTE = re.compile(r"(@import\s+(url\()?\s*['\"]?|url\(\s*['\"]?)(https?:)?//", re.I)


def _hook() -> ModuleType:
    """docs_hooks/openapi_routes.py, loaded by path as mkdocs loads it."""
    spec = importlib.util.spec_from_file_location(
        "openapi_routes", REPO / "docs_hooks" / "openapi_routes.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _no_network_prefix() -> list[str]:
    """``unshare -rn`` (a network namespace with nothing in it) where this machine allows."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    probe = subprocess.run(bound([unshare, "-rn", "true"]), capture_output=True, timeout=10)
    return [unshare, "-rn"] if probe.returncode == 0 else []


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    dead = "http://127.0.0.1:9"  # the discard port: a fetch that slips past fails at once
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "NO_MKDOCS_2_WARNING": "1",
        **{name: dead for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")},
        **{name.lower(): dead for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")},
        "NO_PROXY": "",
        "no_proxy": "",
    }
    argv = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "mkdocs.yml", "-d"]
    proc = subprocess.run(
        bound([*_no_network_prefix(), *argv, str(out)]),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


class _Assets(HTMLParser):
    """Collects every URL a page fetches while it loads, and its inline styles."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.styles: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._in_style = tag == "style"
        for name, value in attrs:
            if value and name in ASSET_ATTRS.get(tag, ()):
                self.urls += [part.split()[0] for part in value.split(",") if part.strip()]
            if name == "style" and value:
                self.styles.append(value)

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self.styles.append(data)


def test_every_page_is_built(site: Path) -> None:
    pages = {p.stem for p in (REPO / "docs").glob("*.md")}
    built = {p.parent.name if p.name == "index.html" else p.stem for p in site.rglob("*.html")}
    assert pages <= built | {"index"}, f"not built: {sorted(pages - built)}"
    for required in ("quickstart", "concepts", "tasks", "deploy", "http-api", "metrics"):
        assert required in pages


def test_no_page_loads_anything_from_another_host(site: Path) -> None:
    remote: list[str] = []
    for page in site.rglob("*.html"):
        name, html = page.relative_to(site), page.read_text(encoding="utf-8")
        parser = _Assets()
        parser.feed(html)
        remote += [f"{name}: {u}" for u in parser.urls if REMOTE.match(u)]
        remote += [f"{name}: inline style" for s in parser.styles if CSS_REMOTE.search(s)]
        # Material's bundle fetches mermaid from a CDN when a page has a diagram.
        if 'class="mermaid"' in html:
            remote.append(f"{name}: a mermaid diagram (loads unpkg.com)")
    for sheet in site.rglob("*.css"):
        if CSS_REMOTE.search(sheet.read_text(encoding="utf-8")):
            remote.append(f"{sheet.relative_to(site)}: remote url() or @import")
    assert not remote, "pages that fetch from other hosts:\n" + "\n".join(remote)


def test_the_detector_sees_remote_assets() -> None:
    parser = _Assets()
    parser.feed(
        '<link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto">'
        '<script src="//cdn.example.org/x.js"></script><img src="img/local.png">'
        "<style>@import url('https://example.org/a.css');</style>"
    )
    assert [u for u in parser.urls if REMOTE.match(u)] == [
        "https://fonts.googleapis.com/css?family=Roboto",
        "//cdn.example.org/x.js",
    ]
    assert any(CSS_REMOTE.search(s) for s in parser.styles)
    assert not CSS_REMOTE.search("src: url(data:font/woff2;base64,AAAA) url(../fonts/x.woff2)")


def test_the_http_api_page_carries_the_openapi_route_table(site: Path) -> None:
    html = (site / "http-api" / "index.html").read_text(encoding="utf-8")
    document = _hook().load_document()
    if document is None:  # flotilla.server.http.openapi not written yet: marker kept
        assert "<!-- openapi-routes -->" in html
        return
    assert "<!-- openapi-routes -->" not in html
    for path, item in document["paths"].items():
        assert f"<code>{path}</code>" in html, f"{path} is missing from the HTTP API page"
        assert any(f"<code>{m.upper()}</code>" in html for m in item if m != "parameters")


FAKE: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "Flotilla", "version": "1"},
    "security": [{"bearer": []}],
    "paths": {
        "/healthz": {"get": {"summary": "Liveness", "security": []}},
        "/api/v1/jobs": {
            "parameters": [],
            "get": {"summary": "List jobs | with metrics"},
            "post": {
                "description": "Submit a job.\nThe body is TOML.",
                "security": [{"bearer": ["operator"]}],
            },
        },
        "/api/v1/jobs/{id}/cancel": {"post": {"summary": "Cancel", "x-flotilla-scope": "operator"}},
        "/api/v1/jobs/{id}/model": {
            "get": {"summary": "Export", "responses": {"401": {}, "404": {}}},
            "delete": {"summary": "Drop", "responses": {"401": {}, "403": {}}},
        },
    },
}


def test_the_hook_renders_one_row_per_operation_with_its_token() -> None:
    hook = _hook()
    assert hook.route_rows(FAKE) == [
        ("GET", "/healthz", "Liveness", "none"),
        ("GET", "/api/v1/jobs", "List jobs | with metrics", "operator or read token"),
        ("POST", "/api/v1/jobs", "Submit a job.", "operator token"),
        ("POST", "/api/v1/jobs/{id}/cancel", "Cancel", "operator token"),
        ("GET", "/api/v1/jobs/{id}/model", "Export", "operator or read token"),
        ("DELETE", "/api/v1/jobs/{id}/model", "Drop", "operator token"),
    ]
    table = hook.render_table(FAKE)
    assert "| `GET` | `/api/v1/jobs` | List jobs \\| with metrics | operator or read token |" in (
        table.splitlines()
    )
    assert "OpenAPI 3.1.0 document (Flotilla 1)" in table


def test_the_hook_replaces_the_marker_or_leaves_it_without_a_document() -> None:
    hook = _hook()
    page = "# HTTP API\n\n<!-- openapi-routes -->\n\nMore.\n"
    rendered = hook.replace_marker(page, lambda: FAKE)
    assert "<!-- openapi-routes -->" not in rendered and "`/healthz`" in rendered
    assert rendered.startswith("# HTTP API\n") and rendered.endswith("More.\n")
    assert hook.replace_marker(page, lambda: None) == page
    assert hook.replace_marker("# Other\n", lambda: FAKE) == "# Other\n"
