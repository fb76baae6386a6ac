"""Plain data (TOML tables, JSON objects) onto frozen dataclasses, every field checked.

Unknown or ill-typed fields raise :class:`SpecError` naming the field and the source, so a
typo never silently falls back to a default. Job specs, experiments, strategy and
selector parameters and a job's ``[eligibility]`` all build through :func:`build_dataclass`.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from flotilla.core.errors import SpecError

T = TypeVar("T")


def build_dataclass(cls: type[T], data: Mapping[str, Any], source: str, prefix: str = "") -> T:
    """Build a (nested) dataclass from plain data, refusing unknown and ill-typed fields."""
    if not isinstance(data, Mapping):
        where = prefix.rstrip(".") or "the top level"
        raise SpecError(f"{source}: {where} must be a table, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = get_type_hints(cls)
    for key in data:
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise SpecError(f"{source}: unknown field '{prefix}{key}' (known: {known})")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, source, f"{prefix}{name}")
    try:
        return cls(**kwargs)
    except SpecError as exc:
        raise SpecError(f"{source}: {exc}") from exc


def _scalar_table(value: Any, source: str, field: str) -> dict[str, Any]:
    """A parameters table: names to scalars (or lists of scalars), checked by its consumer."""
    if not isinstance(value, Mapping):
        raise SpecError(f"{source}: field '{field}' must be a table, got {value!r}")
    out: dict[str, Any] = {}
    for key, item in value.items():
        scalars = (str, int, float, bool)
        ok = isinstance(item, scalars) or (
            isinstance(item, (list, tuple)) and all(isinstance(v, scalars) for v in item)
        )
        if not ok:
            raise SpecError(f"{source}: field '{field}.{key}' must be a scalar, got {item!r}")
        out[str(key)] = list(item) if isinstance(item, (list, tuple)) else item
    return out


def _coerce(hint: Any, value: Any, source: str, field: str) -> Any:
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return build_dataclass(hint, value, source, f"{field}.")
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        args = get_args(hint)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, source, field)
            except SpecError:
                continue
        raise SpecError(f"{source}: field '{field}' has the wrong type ({value!r})")
    if origin is dict:
        return _scalar_table(value, source, field)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise SpecError(f"{source}: field '{field}' must be a list, got {value!r}")
        args = get_args(hint)
        if origin is tuple and args and Ellipsis not in args:  # fixed length, e.g. a pair
            if len(value) != len(args):
                raise SpecError(
                    f"{source}: field '{field}' must be a list of {len(args)} items, got {value!r}"
                )
            pairs = enumerate(zip(args, value, strict=True))
            return tuple(_coerce(a, v, source, f"{field}[{i}]") for i, (a, v) in pairs)
        (item,) = args[:1] or (Any,)
        return tuple(_coerce(item, v, source, f"{field}[{i}]") for i, v in enumerate(value))
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(f"{source}: field '{field}' must be a number, got {value!r}")
        try:
            return float(value)
        except OverflowError:  # an integer past float's range, e.g. 10**400
            raise SpecError(f"{source}: field '{field}' is out of range") from None
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{source}: field '{field}' must be an integer, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise SpecError(f"{source}: field '{field}' must be true or false, got {value!r}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise SpecError(f"{source}: field '{field}' must be a string, got {value!r}")
        return value
    return value
