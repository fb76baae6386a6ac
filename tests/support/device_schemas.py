"""The device protocol's JSON Schemas (flotilla/mobile/schema/v1), loaded for tests that
check every message a device sends or receives against them."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource

SCHEMA_DIR = Path(__file__).resolve().parents[2] / "flotilla" / "mobile" / "schema" / "v1"
BASE = "https://schemas.flotilla.dev/device/v1/"


@cache
def _registry() -> Registry:
    resources = []
    for path in sorted(SCHEMA_DIR.glob("*.schema.json")):
        doc = json.loads(path.read_text())
        resources.append((doc["$id"], Resource.from_contents(doc)))
    return Registry().with_resources(resources)


def schema_names() -> list[str]:
    return sorted(p.name.removesuffix(".schema.json") for p in SCHEMA_DIR.glob("*.schema.json"))


def check(name: str, instance: Any) -> None:
    """``instance`` is a valid ``name`` message (AssertionError listing every violation)."""
    doc = json.loads((SCHEMA_DIR / f"{name}.schema.json").read_text())
    validator = Draft202012Validator(doc, registry=_registry())
    errors = sorted(validator.iter_errors(instance), key=lambda e: list(e.path))
    assert not errors, f"{name}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:5])
