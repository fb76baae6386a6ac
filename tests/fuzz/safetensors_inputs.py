"""Inputs for the safetensors-based decoders (model states and codec payloads): valid
payloads mutated as bytes, and headers rebuilt with hostile entries (the JSON is where
sizes and offsets live, so that is where a decoder must not trust them)."""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Sequence

from hypothesis import strategies as st

from tests.fuzz.harness import INTERESTING, json_value, mutated, recipes

_DTYPES = ("F32", "F16", "F64", "I64", "I8", "U8", "BOOL", "f32", "", "X")
_META = ("", "{}", "[]", "[4]", "[1e400]", "[2, -1]", '{"k": 0}', "[10, 15]", "[150]")


def _int(rng: random.Random) -> object:
    pick = rng.randrange(4)
    if pick == 0:
        return rng.choice(INTERESTING)
    if pick == 1:
        return rng.choice((-1, True, 1.5, None, "3"))
    return rng.randint(-2, 160)


def _ints(rng: random.Random, low: int, high: int) -> list[object]:
    return [_int(rng) for _ in range(rng.randint(low, high))]


def rebuild(message: bytes, rng: random.Random) -> bytes:
    """A seed's header as JSON with entries changed, added or removed, framed again (the
    length prefix right, or patched), followed by its data, cut or grown."""
    (hlen,) = struct.unpack("<Q", message[:8])
    header = json.loads(message[8 : 8 + hlen])
    data = message[8 + hlen :]
    names = [k for k in header if k != "__metadata__"] or ["t"]
    for _ in range(rng.randint(1, 3)):
        name = rng.choice([*names, "__metadata__", "x"])
        entry = header.get(name)
        what = rng.randrange(7)
        if what == 0 or not isinstance(entry, dict):
            header[name] = {
                "dtype": rng.choice(_DTYPES),
                "shape": _ints(rng, 0, 4),
                "data_offsets": _ints(rng, 2, 3),
            }
        elif what == 1:
            entry["shape"] = _ints(rng, 0, 5) if rng.random() < 0.8 else _int(rng)
        elif what == 2:
            entry["data_offsets"] = _ints(rng, 0, 3)
        elif what == 3:
            entry["dtype"] = rng.choice(_DTYPES)
        elif what == 4:
            header.pop(name, None)
        elif what == 5:
            entry[rng.choice(("dtype", "shape", "data_offsets", "extra"))] = json_value(rng)
        else:
            meta = header.setdefault("__metadata__", {})
            if isinstance(meta, dict):
                key = rng.choice(("format", "codec", "params", "shape", "k"))
                meta[key] = rng.choice(_META) if rng.random() < 0.7 else json_value(rng)
    text = json.dumps(header).encode()
    length = len(text) if rng.random() < 0.8 else rng.choice(INTERESTING)
    tail = rng.choice((data, data[:-1], data + b"\0" * 4, b"", data[: len(data) // 2]))
    return struct.pack("<Q", length % 2**64) + text + tail


def safetensors_inputs(seeds: Sequence[bytes]) -> st.SearchStrategy[bytes]:
    return mutated(seeds) | recipes(seeds, rebuild)
