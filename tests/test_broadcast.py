"""Downlink broadcasts: exact, codec-encoded, or compressed changes a device rebuilds from."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flotilla.client.config import rebuild_model
from flotilla.compression import make_codec
from flotilla.core.blobstore import BlobStore
from flotilla.core.errors import IntegrityError
from flotilla.core.tensors import decode_state, encode_state, state_spec
from flotilla.engine.broadcast import Broadcaster
from flotilla.proto import flotilla_pb2 as pb


def _models(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    model = {"w": rng.standard_normal((64, 32), dtype=np.float32), "b": np.zeros(32, np.float32)}
    out = [model]
    for _ in range(n - 1):
        model = {
            k: v + 0.01 * rng.standard_normal(v.shape, dtype=np.float32) for k, v in model.items()
        }
        out.append(model)
    return out


def _task(broadcast, layout, codec: str) -> pb.TrainTask:  # type: ignore[no-untyped-def]
    config = {
        "compression": {"downlink": codec, "downlink_delta": True},
        "layout": [[s.name, s.dtype, list(s.shape)] for s in layout],
    }
    return pb.TrainTask(
        config_json=json.dumps(config),
        model_sha256=broadcast.sha256,
        delta_base_sha256=broadcast.delta_base_sha256,
        delta_sha256=broadcast.delta_sha256,
    )


def test_devices_rebuild_every_broadcast_bit_for_bit(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    caster = Broadcaster(blobs, make_codec("int8"), delta=True)
    models = _models(6)
    layout = state_spec(models[0])
    first = caster.prepare(blobs.put(encode_state(models[0])))
    assert not first.delta_sha256, "the first broadcast is the exact model"
    held = memoryview(blobs.get(first.sha256))
    for model in models[1:]:
        cast = caster.prepare(blobs.put(encode_state(model)))
        assert cast.delta_base_sha256 == blobs.path(cast.delta_base_sha256).name
        assert cast.delta_size < 0.3 * cast.size, "the change travels at about 1 byte a value"
        held = rebuild_model(
            held, memoryview(blobs.get(cast.delta_sha256)), _task(cast, layout, "int8")
        )
        assert bytes(held) == blobs.get(cast.sha256)
    # What the reference lost to the codec is carried forward, so it tracks the real model.
    rebuilt = decode_state(held)
    for name, value in models[-1].items():
        assert np.abs(rebuilt[name] - value).max() < 0.01


def test_a_rebuild_from_the_wrong_base_is_refused(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    caster = Broadcaster(blobs, make_codec("int8"), delta=True)
    models = _models(3)
    layout = state_spec(models[0])
    caster.prepare(blobs.put(encode_state(models[0])))
    cast = caster.prepare(blobs.put(encode_state(models[1])))
    wrong = memoryview(encode_state(models[2]))
    with pytest.raises(IntegrityError, match="does not match"):
        rebuild_model(wrong, memoryview(blobs.get(cast.delta_sha256)), _task(cast, layout, "int8"))


def test_codec_broadcast_without_delta_is_the_encoded_model(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    model = _models(1)[0]
    cast = Broadcaster(blobs, make_codec("fp16"), delta=False).prepare(
        blobs.put(encode_state(model))
    )
    assert cast.size == pytest.approx(len(encode_state(model)) / 2, rel=0.05)
    exact = Broadcaster(blobs, None, delta=False).prepare(blobs.put(encode_state(model)))
    assert blobs.get(exact.sha256) == encode_state(model)
