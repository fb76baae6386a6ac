"""mkdocs hook: the HTTP API page's route table, built from the OpenAPI document.

The table in ``docs/http-api.md`` is generated at build time from
``flotilla.server.http.openapi.document()``, the same document the server serves at
``/openapi.json``, so the page cannot drift from what the endpoints do. The marker
``<!-- openapi-routes -->`` is replaced by one row per operation: method, path, summary,
and who may call it.

Who may call it is read from the document: an operation's ``security`` (or the
document's), where ``[]`` or an empty requirement means no token; the roles listed in a
requirement (``{"bearer": ["operator"]}``), a ``403`` response (a token that is valid but
not enough: a read token), or an ``x-flotilla-scope`` of ``operator`` or ``read``, say
which token. While ``flotilla.server.http.openapi`` does not exist, the marker
is left as it is and the build goes on; any other import error fails the build.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

#: Replaced by the route table wherever it appears in a page.
MARKER = "<!-- openapi-routes -->"
#: The module that builds the document, imported only when a page holds the marker.
OPENAPI_MODULE = "flotilla.server.http.openapi"
#: Operation keys of an OpenAPI path item, in the order rows are written.
METHODS = ("get", "put", "post", "patch", "delete", "head", "options", "trace")

log = logging.getLogger("mkdocs.hooks.openapi_routes")

Document = Mapping[str, Any]


def load_document() -> Document | None:
    """The server's OpenAPI document, or None while its module is not written yet."""
    try:
        module = importlib.import_module(OPENAPI_MODULE)
    except ModuleNotFoundError as exc:
        parent = OPENAPI_MODULE.rpartition(".")[0]
        if exc.name in (OPENAPI_MODULE, parent):
            return None
        raise
    document: Document = module.document()
    return document


def auth_of(operation: Mapping[str, Any], document: Document) -> str:
    """Which token an operation takes, in words."""
    scope = operation.get("x-flotilla-scope")
    if scope == "operator":
        return "operator token"
    if scope == "read":
        return "operator or read token"
    requirements = operation.get("security", document.get("security", []))
    if not requirements or any(not requirement for requirement in requirements):
        return "none"
    roles = {role for requirement in requirements for values in requirement.values()
             for role in values}  # fmt: skip
    if roles == {"operator"} or "403" in operation.get("responses", {}):
        return "operator token"
    return "operator or read token"


def _cell(text: str) -> str:
    """Table-safe text: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def route_rows(document: Document) -> list[tuple[str, str, str, str]]:
    """(method, path, summary, auth) for every operation, in the document's path order."""
    rows = []
    for path, item in document.get("paths", {}).items():
        for method in METHODS:
            operation = item.get(method)
            if operation is None:
                continue
            summary = operation.get("summary") or operation.get("description", "")
            summary = summary.strip().split("\n")[0]
            rows.append((method.upper(), path, summary, auth_of(operation, document)))
    return rows


def render_table(document: Document) -> str:
    """The Markdown table of every route, with the document's title and version under it."""
    lines = ["| Method | Path | Summary | Token |", "|---|---|---|---|"]
    for method, path, summary, auth in route_rows(document):
        lines.append(f"| `{method}` | `{_cell(path)}` | {_cell(summary)} | {auth} |")
    info = document.get("info", {})
    lines += [
        "",
        f"*Generated from the OpenAPI {document.get('openapi', '')} document "
        f"({_cell(str(info.get('title', '')))} {_cell(str(info.get('version', '')))}).*",
    ]
    return "\n".join(lines)


def replace_marker(markdown: str, loader: Callable[[], Document | None]) -> str:
    """``markdown`` with the marker replaced by the route table (unchanged if no document)."""
    if MARKER not in markdown:
        return markdown
    document = loader()
    if document is None:
        log.info("%s is not available: the HTTP API route table is left out", OPENAPI_MODULE)
        return markdown
    return markdown.replace(MARKER, render_table(document))


def on_page_markdown(markdown: str, **_: Any) -> str:
    """The mkdocs event: every page's Markdown passes through here before rendering."""
    return replace_marker(markdown, load_document)
