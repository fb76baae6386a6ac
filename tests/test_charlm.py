"""The char LM task: a real corpus from the stdlib's docstrings, disjoint shards, a causal model
that learns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from flotilla.core.spec import DataSection, TrainSection
from flotilla.tasks import Shard, load_task
from flotilla.tasks.charlm import ALPHABET, CharLMTask, decode, encode, load_corpus, windows


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def task(corpus_dir: Path) -> CharLMTask:
    return CharLMTask(corpus_dir)


def test_corpus_is_english_prose_from_the_stdlib_and_is_cached(
    task: CharLMTask, corpus_dir: Path
) -> None:
    text = decode(task.tokens())
    assert len(text) > 1_000_000
    assert set(text) <= set(ALPHABET)
    # Real docstrings: words a reader of the stdlib docs would expect, many times over.
    for word in ("Return the", "string", "If the"):
        assert text.count(word) > 100, word
    cached = list((corpus_dir / "charlm").glob("docstrings-py*.txt"))
    assert len(cached) == 1
    assert load_corpus(corpus_dir) == text


def test_encode_drops_characters_outside_the_alphabet() -> None:
    assert decode(encode("caf\u00e9 ok\n")) == "caf ok\n"


def test_windows_pair_each_character_with_the_next() -> None:
    tokens = encode("abcdefghij")
    x, y = windows(tokens, 3)
    assert x.shape == y.shape == (3, 3)
    assert decode(x[1].numpy()) == "def"
    assert decode(y[1].numpy()) == "efg"
    with pytest.raises(ValueError, match="cannot fill one window"):
        windows(tokens[:2], 3)


def test_shards_are_disjoint_and_never_touch_the_heldout_text(task: CharLMTask) -> None:
    data = DataSection(params={"context": 32})
    train_text = decode(task.tokens()[: task._split_at()])
    start = 0
    for i in range(4):
        local = task.load_shard(Shard(i, 4), data)
        rows = torch.cat([local.train[0], local.val[0]])
        # Shard i reads the i-th contiguous quarter of the training text, nothing else.
        size = len(train_text) // 4 + (1 if i < len(train_text) % 4 else 0)
        piece = train_text[start : start + size]
        start += size
        assert len(rows) == (len(piece) - 1) // 32
        assert {decode(r.numpy()) for r in rows} == {
            piece[j : j + 32] for j in range(0, len(rows) * 32, 32)
        }
    assert start == len(train_text)
    held_x, held_y = task.heldout()
    assert held_x.shape[1] == task.context
    assert torch.equal(held_x[:, 1:], held_y[:, :-1])
    tail = decode(task.tokens()[task._split_at() :])
    assert decode(held_x[0].numpy()) == tail[: task.context]


def test_bad_data_params_are_named(task: CharLMTask) -> None:
    with pytest.raises(Exception, match="contxt"):
        task.load_shard(Shard(0, 2), DataSection(params={"contxt": 8}))
    with pytest.raises(ValueError, match="exceeds the model"):
        task.load_shard(Shard(0, 2), DataSection(params={"context": 4096}))


def test_model_is_deterministic_and_causal(task: CharLMTask) -> None:
    a, b = task.build_model(7), task.build_model(7)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(task.build_model(8).state_dict()["embed.weight"], pa.new_zeros(1))
    ids = torch.from_numpy(encode("The quick brown fox jumps over")).unsqueeze(0)
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % len(ALPHABET)
    with torch.no_grad():
        out, out_changed = a(ids), a(changed)
    # Only the last position may see the last token.
    assert torch.allclose(out[0, :-1], out_changed[0, :-1], atol=1e-6)
    assert not torch.allclose(out[0, -1], out_changed[0, -1])


def test_training_lowers_heldout_bits_per_char(task: CharLMTask) -> None:
    model = task.build_model(0)
    data = task.load_shard(Shard(0, 8), DataSection(params={"max_windows": 320}))
    held = task.heldout()
    before = task.evaluate(model, held)
    config = TrainSection(learning_rate=3e-3, batch_size=32, local_epochs=3)
    n, metrics = task.train(model, data, config, seed=0)
    after = task.evaluate(model, held)
    assert n == 320
    assert np.isfinite(metrics["train_loss"])
    assert before["bits_per_char"] > 6.0  # uniform over ~100 characters: log2(100)
    assert after["bits_per_char"] < before["bits_per_char"] - 1.5
    assert after["accuracy"] > 0.15
    assert after["bits_per_char"] == pytest.approx(after["loss"] / np.log(2))


def test_loads_by_entry_point(corpus_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_CACHE_DIR", str(corpus_dir))
    task = load_task("flotilla.tasks.charlm:CharLMTask")
    assert isinstance(task, CharLMTask)
    assert len(task.corpus_sha256()) == 64
