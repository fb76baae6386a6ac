"""Codecs by name, as job specs and payload metadata spell them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from flotilla.compression.codec import Codec, WireCodec, read_codec_metadata
from flotilla.compression.floats import Bf16Codec, Fp16Codec, NoneCodec
from flotilla.compression.quantize import Int4Codec, Int8Codec, QsgdCodec
from flotilla.compression.sparse import RandKCodec, TopKCodec
from flotilla.core.errors import SpecError, WireError

_CODECS: Mapping[str, type[WireCodec]] = MappingProxyType(
    {
        cls.name: cls
        for cls in (
            NoneCodec,
            Fp16Codec,
            Bf16Codec,
            Int8Codec,
            Int4Codec,
            QsgdCodec,
            TopKCodec,
            RandKCodec,
        )
    }
)
CODEC_NAMES: tuple[str, ...] = tuple(_CODECS)


def make_codec(name: str, params: Mapping[str, Any] | None = None) -> Codec:
    """The codec called ``name`` with ``params``; SpecError names a bad name or parameter."""
    cls = _CODECS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise SpecError(f"unknown codec {str(name)[:40]!r}; valid codecs: {', '.join(CODEC_NAMES)}")
    params = dict(params or {})
    known = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(str(key) for key in set(params) - set(known))
    if unknown:
        raise SpecError(
            f"codec {name!r}: unknown parameter {unknown[0][:40]!r}; "
            f"valid parameters: {', '.join(known) or '(none)'}"
        )
    codec: Codec = cls(**params)
    return codec


def codec_from_metadata(meta: Mapping[str, str]) -> Codec:
    """The codec a payload's ``__metadata__`` names; WireError if it names none we know."""
    name, params = read_codec_metadata(meta)
    try:
        return make_codec(name, params)
    except SpecError as exc:
        raise WireError(f"payload names a bad codec: {exc}") from exc
