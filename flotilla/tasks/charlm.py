"""A tiny causal transformer language model on the English in the Python stdlib's docstrings.

The corpus is real English prose that every Python install carries (module, class and
function docstrings, ~2 MB), so volunteer pretraining runs, demos and tests need no
download. It is built at first use by parsing the standard library's sources with
:mod:`ast` (never importing them) and cached on disk, keyed by the Python version and a hash
of its text, since another Python release has other docstrings.

The last :data:`HELDOUT_FRACTION` of the corpus is the held-out split; the rest is cut into
``count`` contiguous pieces, one per shard (peer or device), each read as non-overlapping
windows of ``context + 1`` characters (inputs and next-character targets). Metrics: ``loss``
(nats per character), ``bits_per_char`` and next-character ``accuracy``.
"""

from __future__ import annotations

import ast
import hashlib
import math
import os
import string
import sys
import sysconfig
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from flotilla.core.files import write_atomic
from flotilla.tasks.base import Examples, LocalData, Shard, proximal_anchor, proximal_term

if TYPE_CHECKING:
    from flotilla.core.spec import DataSection, TrainSection

#: Every character the model knows: printable ASCII and newline; others are dropped.
ALPHABET = "\n" + "".join(c for c in string.printable if c.isprintable())
VOCAB = len(ALPHABET)
HELDOUT_FRACTION = 0.05
#: Held-out windows evaluated (from the start of the held-out text): enough for a steady
#: estimate, few enough that a volunteer evaluates in well under a second.
HELDOUT_WINDOWS = 256
VAL_FRACTION = 0.1
#: Directories of the standard library whose docstrings are not prose worth learning.
_SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "turtledemo"}
)
_CODES = np.full(128, -1, dtype=np.int16)
_CODES[[ord(c) for c in ALPHABET]] = np.arange(VOCAB, dtype=np.int16)


def stdlib_docstrings(root: Path | None = None) -> str:
    """Every distinct docstring of at least 40 characters under the stdlib, in path order."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    out: list[str] = []
    for path in sorted(base.rglob("*.py")):
        if _SKIP_DIRS.intersection(path.relative_to(base).parts):
            continue
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if not isinstance(
                node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            ):
                continue
            doc = ast.get_docstring(node, clean=True)
            if doc is None:
                continue
            doc = "".join(c for c in doc if c in ALPHABET).strip()
            if len(doc) >= 40 and doc not in seen:
                seen.add(doc)
                out.append(doc)
    return "\n\n".join(out) + "\n"


def cache_dir() -> Path:
    """``$FLOTILLA_CACHE_DIR``, else ``$XDG_CACHE_HOME/flotilla``, else ``~/.cache/flotilla``."""
    explicit = os.environ.get("FLOTILLA_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "flotilla"


def load_corpus(directory: Path | None = None) -> str:
    """The corpus, built once per Python version and then read from the cache."""
    where = (directory or cache_dir()) / "charlm"
    path = where / f"docstrings-py{sys.version_info[0]}.{sys.version_info[1]}.txt"
    try:
        return path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        pass
    text = stdlib_docstrings()
    where.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text.encode("ascii"))  # peers starting together never read half a file
    return text


def encode(text: str) -> np.ndarray:
    """Characters to token ids (int64); characters outside :data:`ALPHABET` are dropped."""
    raw = np.frombuffer(text.encode("ascii", errors="ignore"), dtype=np.uint8)
    codes = _CODES[raw[raw < 128]]
    return codes[codes >= 0].astype(np.int64)


def decode(ids: np.ndarray | list[int]) -> str:
    return "".join(ALPHABET[int(i)] for i in ids)


def windows(tokens: np.ndarray, context: int) -> Examples:
    """Non-overlapping ``context + 1`` windows: (inputs, next-character targets), (N, context)."""
    n = (len(tokens) - 1) // context
    if n < 1:
        raise ValueError(f"{len(tokens)} characters cannot fill one window of {context + 1}")
    body = np.array(tokens[: n * context + 1], dtype=np.int64)
    return (
        torch.from_numpy(body[:-1].reshape(n, context).copy()),
        torch.from_numpy(body[1:].reshape(n, context).copy()),
    )


@dataclass(frozen=True, slots=True)
class CharLMParams:
    """``data.params`` of the char LM."""

    #: Characters the model sees at once (its position table has this many rows).
    context: int = 64
    #: At most this many training windows per shard (0: all of the shard's text).
    max_windows: int = 0

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> CharLMParams:
        from flotilla.core.tables import build_dataclass

        made = build_dataclass(cls, params, "charlm task", "data.params.")
        if made.context < 2 or made.max_windows < 0:
            raise ValueError("data.params: charlm needs context >= 2 and max_windows >= 0")
        return made


class CausalBlock(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(w, dim=2)
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, w))
        out: torch.Tensor = x + self.down(F.gelu(self.up(self.norm2(x))))
        return out


class CharTransformer(nn.Module):
    """Token and position embeddings, causal blocks, a linear head over :data:`ALPHABET`."""

    def __init__(self, context: int, width: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(CausalBlock(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.embed(ids) + self.position.weight[:t]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # type: ignore[no-any-return]


class CharLMTask:
    """Causal char-level transformer on stdlib docstrings; implements :class:`Task`.

    Trains with Adam at ``train.learning_rate`` (``momentum`` is unused; a rate around 3e-3
    suits it). Larger variants subclass and change the class attributes.
    """

    context: int = 64
    width: int = 64
    heads: int = 4
    layers: int = 2

    def __init__(self, corpus_dir: Path | None = None) -> None:
        self._corpus_dir = corpus_dir
        self._tokens: np.ndarray | None = None

    def tokens(self) -> np.ndarray:
        """The whole corpus as token ids, loaded once per task instance."""
        if self._tokens is None:
            self._tokens = encode(load_corpus(self._corpus_dir))
        return self._tokens

    def corpus_sha256(self) -> str:
        """Identifies the text, so peers can tell they train on the same corpus."""
        return hashlib.sha256(self.tokens().astype(np.uint8).tobytes()).hexdigest()

    def _split_at(self) -> int:
        return int(len(self.tokens()) * (1.0 - HELDOUT_FRACTION))

    def build_model(self, seed: int) -> nn.Module:
        gen = torch.Generator().manual_seed(seed)
        with torch.device("meta"):
            model = CharTransformer(self.context, self.width, self.heads, self.layers)
        model = model.to_empty(device="cpu")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif "norm" in name:
                    p.fill_(1.0)
                else:  # GPT-2's N(0, 0.02), residual projections scaled by depth
                    std = (
                        0.02 / math.sqrt(2 * self.layers)
                        if name.endswith(("proj.weight", "down.weight"))
                        else 0.02
                    )
                    p.normal_(0.0, std, generator=gen)
        return model

    def load_shard(self, shard: Shard, data: DataSection) -> LocalData:
        p = CharLMParams.from_params(data.params)
        self._check_context(p)
        train_text = self.tokens()[: self._split_at()]
        piece = np.array_split(train_text, shard.count)[shard.index]
        x, y = windows(piece, p.context)
        order = torch.from_numpy(
            np.random.default_rng([data.seed % 2**64, shard.count, shard.index]).permutation(len(y))
        )
        n_val = max(1, round(VAL_FRACTION * len(order)))
        val, train = order[:n_val], order[n_val:]
        if p.max_windows:
            train = train[: p.max_windows]
        if len(train) < 1:
            raise ValueError(f"shard {shard} of the char LM corpus is too small to train on")
        return LocalData(train=(x[train], y[train]), val=(x[val], y[val]))

    def _check_context(self, p: CharLMParams) -> None:
        if p.context > self.context:
            raise ValueError(
                f"data.params.context {p.context} exceeds the model's {self.context} positions"
            )

    def heldout(self) -> Examples:
        tail = self.tokens()[self._split_at() :]
        x, y = windows(tail[: HELDOUT_WINDOWS * self.context + 1], self.context)
        return x, y

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean next-character cross-entropy (nats) of a batch of windows."""
        logits: torch.Tensor = model(x)
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    def batches(
        self, data: LocalData, batch_size: int, seed: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless shuffled minibatches of the shard's training windows (volunteer runs)."""
        x, y = data.train
        gen = torch.Generator().manual_seed(seed)
        while True:
            order = torch.randperm(len(y), generator=gen)
            for start in range(0, len(y), batch_size):
                idx = order[start : start + batch_size]
                yield x[idx], y[idx]

    def train(
        self, model: nn.Module, data: LocalData, config: TrainSection, seed: int
    ) -> tuple[int, dict[str, float]]:
        opt = torch.optim.Adam(
            model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay
        )
        anchor = proximal_anchor(model, config.proximal_mu)
        n = int(data.train[1].shape[0])
        steps = config.local_epochs * math.ceil(n / config.batch_size)
        model.train()
        total, chars = 0.0, 0
        batches = self.batches(data, config.batch_size, seed)
        for _ in range(steps):
            x, y = next(batches)
            loss = self.loss(model, x, y)
            if anchor:
                loss = loss + proximal_term(model, anchor, config.proximal_mu)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            total += float(loss.detach()) * y.numel()
            chars += y.numel()
        mean = total / max(chars, 1)
        return n, {"train_loss": mean, "train_bits_per_char": mean / math.log(2)}

    def evaluate(self, model: nn.Module, data: Examples) -> dict[str, float]:
        x, y = data
        model.eval()
        with torch.no_grad():
            logits = model(x).reshape(-1, VOCAB)
            target = y.reshape(-1)
            loss = float(F.cross_entropy(logits, target)) if len(target) else 0.0
            acc = float((logits.argmax(dim=1) == target).float().mean()) if len(target) else 0.0
        return {
            "accuracy": acc,
            "loss": loss,
            "bits_per_char": loss / math.log(2),
            "num_samples": float(len(y)),
        }
