"""docs/p2p-protocol.md is true: its JSON Schemas accept what flotilla writes and refuse
what it refuses, and its test vectors are what the code computes, from the byte layouts
the page describes written out again here with the standard library."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import re
import struct
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.compression import CompressionInfo

from flotilla.p2p.codecs import FlotillaInt8
from flotilla.p2p.dht import PeerMetrics, RunStatus
from flotilla.p2p.record import RunRecord, sign_record, verify_record
from flotilla.p2p.swarm import model_sha256
from flotilla.p2p.volunteer import shard_of

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGE = (DOCS / "p2p-protocol.md").read_text()


def schema(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((DOCS / "p2p-protocol" / f"{name}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(loaded)
    return loaded


def record() -> RunRecord:
    return RunRecord(run="docs-lm", task="flotilla.tasks.charlm:CharLMTask", model_sha256="a" * 64)


def test_the_signed_record_matches_its_schemas_and_verifies_as_the_page_says() -> None:
    signed = sign_record(record(), Ed25519PrivateKey.generate())
    jsonschema.validate(signed.to_wire(), schema("signed-record"))
    body = json.loads(signed.record_json)
    jsonschema.validate(body, schema("run-record"))
    assert signed.record_json == json.dumps(body, sort_keys=True, separators=(",", ":"))
    assert len(base64.b64decode(signed.public_key)) == 32
    assert len(base64.b64decode(signed.signature)) == 64
    assert verify_record(signed) == record()


@pytest.mark.parametrize(
    "change",
    [
        {"compression": "gzip"},
        {"schema": 4},
        {"shards": 0},
        {"delayed_averaging": "yes"},
        {"extra": 1},
        {"run": "a b"},
        {"averaging": "flood"},
        {"gossip_topology": "star"},
        {"gossip_wait": 0},
    ],
)
def test_the_record_schema_refuses_what_flotilla_refuses(change: dict[str, Any]) -> None:
    body = {**dataclasses.asdict(record()), **change}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(body, schema("run-record"))
    with pytest.raises(Exception):  # noqa: B017 (RunRecordError or SpecError)
        RunRecord.from_dict(body)


def test_metrics_and_status_match_their_schemas() -> None:
    metrics = PeerMetrics("12D3KooW", 3, 40, 640, 12.5, 2.5, {"2": 2.7}, False, 1.7e9)
    jsonschema.validate(dataclasses.asdict(metrics), schema("peer-metrics"))
    status = RunStatus("docs-lm", 3, 2, 25.0, 2.5, [[1, 3.1], [2, 2.7]], 2, 1.7e9)
    jsonschema.validate(dataclasses.asdict(status), schema("run-status"))


def test_model_sha256_is_the_documented_byte_layout_and_test_vector() -> None:
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0]]))
        model.bias.copy_(torch.tensor([0.5]))
    header: dict[str, Any] = {}
    data, offset = b"", 0
    for name, tensor in model.state_dict().items():
        raw = tensor.numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(raw)]}  # fmt: skip
        data, offset = data + raw, offset + len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    blob = struct.pack("<Q", len(text)) + text + data
    assert hashlib.sha256(blob).hexdigest() == model_sha256(model)
    assert f"`model_sha256 = {model_sha256(model)}`" in PAGE
    assert f"bytes `{blob[:8].hex()}`" in PAGE


def test_the_shard_rule_and_its_test_vector() -> None:
    peer, shards = "12D3KooWPLWanso1tHdQGeDLm49UC6cLitHdLRs9CENimRxpHyFk", 64
    index = int.from_bytes(hashlib.sha256(peer.encode()).digest()[:8], "big") % shards
    assert shard_of(peer, shards).index == index
    assert f"`{peer}`, {shards} shards: shard {index}," in PAGE


def test_the_int8_wire_format_and_its_test_vector() -> None:
    values = [0.0, 1.0, -0.5, 0.25, 2.0, -4.0]
    tensor = torch.tensor(values)
    payload = FlotillaInt8(block_size=4).compress(tensor, CompressionInfo.from_tensor(tensor))
    block, expected = 4, b"FLQ8" + struct.pack("<I", 4)
    blocks = [values[i : i + block] for i in range(0, len(values), block)]
    scales = [np.float32(max(abs(v) for v in b)) / np.float32(127) for b in blocks]
    expected += b"".join(struct.pack("<f", s) for s in scales)
    expected += bytes(
        int(np.rint(np.float32(v) * (np.float32(1) / s))) & 0xFF
        for b, s in zip(blocks, scales, strict=True)
        for v in b
    )
    assert payload.buffer == expected
    shown = re.search(r"encodes as\s+`([0-9a-f ]+)`", PAGE)
    assert shown is not None and bytes.fromhex(shown.group(1).replace(" ", "")) == expected
    decoded = FlotillaInt8().extract(payload)
    assert np.allclose(decoded.numpy(), values, atol=4.0 / 254)
