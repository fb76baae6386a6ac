"""Inputs for JSON bodies: valid bodies with fields replaced, removed or added (values
with the edges parsers trip on), serialized again and maybe mutated as bytes, plus
nesting deeper than any parser's recursion."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

from hypothesis import strategies as st

from tests.fuzz.harness import json_value, mutate, mutated, recipes

#: Bodies no well-behaved client sends and every parser must refuse cleanly.
HOSTILE = (
    b"[" * 100_000,
    b'{"a":' * 50_000,
    b"1" * 5000,
    b'{"round_token": "t", "conditions": {"battery": 1' + b"0" * 400 + b"}}",
    b"\xff\xfe",
    b'"\\ud800"',
    b"NaN",
    b"-Infinity",
)


def edit(message: bytes, rng: random.Random) -> bytes:
    """A valid body with one to three fields (at any depth) replaced, removed or added."""
    body = json.loads(message)
    for _ in range(rng.randint(1, 3)):
        node = body
        while isinstance(node, dict) and node and rng.random() < 0.4:
            child = node[rng.choice(list(node))]
            if not isinstance(child, dict):
                break
            node = child
        if not isinstance(node, dict):
            continue
        keys = list(node)
        what = rng.randrange(3)
        if what == 0 and keys:
            node[rng.choice(keys)] = json_value(rng)
        elif what == 1 and keys:
            del node[rng.choice(keys)]
        else:
            node[rng.choice((*keys, "extra"))] = json_value(rng)
    raw = json.dumps(body).encode()  # allow_nan: NaN and Infinity travel as Python writes them
    return mutate(raw, rng) if rng.random() < 0.2 else raw


def json_inputs(seeds: Sequence[bytes]) -> st.SearchStrategy[bytes]:
    return mutated(seeds) | recipes(seeds, edit) | recipes(seeds, edit)
