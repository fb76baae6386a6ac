"""Load-testing tasks: one linear layer of a chosen size, on a few random examples.

They exist so benchmarks measure the platform (transport, aggregation, storage), not the
math: the data is a handful of seeded Gaussian samples (nothing to download), ``train`` is a
single SGD step, and the held-out split is tiny. Use them as any other task, by entry point:

- ``flotilla.tasks.synthetic:Linear100K`` -- 1,000 -> 100 classes, 100,100 parameters
- ``flotilla.tasks.synthetic:Linear10M`` -- 10,000 -> 1,000 classes, 10,001,000 parameters

Every method is deterministic in its seeds and uses private generators only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from flotilla.tasks.base import Examples, LocalData, Shard

if TYPE_CHECKING:
    from flotilla.core.spec import DataSection, TrainSection

#: Seed of the held-out examples, the same for every caller.
HELDOUT_SEED = 7_919
#: Examples per split: enough to make the shapes real, too few to cost time.
SAMPLES = 8


class SyntheticLinear:
    """A linear classifier over random features; subclasses fix its size."""

    in_features: int = 10
    classes: int = 10

    @property
    def num_parameters(self) -> int:
        return self.in_features * self.classes + self.classes

    def build_model(self, seed: int) -> nn.Module:
        with torch.device("meta"):
            model = nn.Linear(self.in_features, self.classes)
        model = model.to_empty(device="cpu")
        gen = torch.Generator().manual_seed(seed % 2**63)
        bound = self.in_features**-0.5
        with torch.no_grad():
            model.weight.uniform_(-bound, bound, generator=gen)
            model.bias.uniform_(-bound, bound, generator=gen)
        return model

    def _examples(self, seed: int, count: int = SAMPLES) -> Examples:
        gen = torch.Generator().manual_seed(seed % 2**63)
        x = torch.randn(count, self.in_features, generator=gen)
        y = torch.randint(0, self.classes, (count,), generator=gen)
        return x, y

    def load_shard(self, shard: Shard, data: DataSection) -> LocalData:
        seed = (data.seed * 1_000_003 + shard.count) * 1_000_003 + shard.index
        return LocalData(train=self._examples(2 * seed), val=self._examples(2 * seed + 1))

    def heldout(self) -> Examples:
        return self._examples(HELDOUT_SEED)

    def train(
        self, model: nn.Module, data: LocalData, config: TrainSection, seed: int
    ) -> tuple[int, dict[str, float]]:
        """One full-batch SGD step: cheap whatever the model size."""
        x, y = data.train
        opt = torch.optim.SGD(model.parameters(), lr=config.learning_rate)
        model.train()
        loss = nn.CrossEntropyLoss()(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return int(y.shape[0]), {"train_loss": float(loss.detach())}

    def evaluate(self, model: nn.Module, data: Examples) -> dict[str, float]:
        x, y = data
        model.eval()
        with torch.no_grad():
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y) if len(y) else torch.tensor(0.0)
            acc = (logits.argmax(dim=1) == y).float().mean() if len(y) else torch.tensor(0.0)
        return {"accuracy": float(acc), "loss": float(loss), "num_samples": float(len(y))}


class Linear100K(SyntheticLinear):
    """100,100 float32 parameters (about 0.4 MB on the wire)."""

    in_features = 1_000
    classes = 100


class Linear10M(SyntheticLinear):
    """10,001,000 float32 parameters (about 40 MB on the wire)."""

    in_features = 10_000
    classes = 1_000
