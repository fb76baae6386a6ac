"""Flower's simulation benchmark workload as a Flotilla task: an MLP 784-128-10 on
synthetic data, 50 examples per client (see docs/simulation.md#bring-your-own-task)."""

import torch
from torch import nn

from flotilla.tasks import LocalData, Shard, proximal_anchor, proximal_term

FEATURES, HIDDEN, CLASSES, SAMPLES = 784, 128, 10, 50


def examples(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian inputs labelled by a fixed random linear teacher, so there is something
    to learn; each seed its own examples, never the global RNG."""
    x = torch.randn(n, FEATURES, generator=torch.Generator().manual_seed(seed))
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(0))
    return x, (x @ teacher).argmax(dim=1)


class FlowerMLP:
    def build_model(self, seed: int) -> nn.Module:
        with torch.random.fork_rng():  # the same weights for a seed, the global RNG untouched
            torch.manual_seed(seed)
            return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))

    def load_shard(self, shard: Shard, data) -> LocalData:  # data: the job's [data] section
        x, y = examples(1 + data.seed * 1_000_003 + shard.index, SAMPLES)
        return LocalData(train=(x, y), val=(x[:0], y[:0]))  # no local validation split

    def heldout(self) -> tuple[torch.Tensor, torch.Tensor]:
        return examples(-1, 1000)

    def example_losses(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-example loss: lets the simulator train many clients as one computation."""
        return nn.functional.cross_entropy(outputs, targets, reduction="none")

    def train(self, model: nn.Module, data: LocalData, config, seed: int):
        x, y = data.train
        opt = torch.optim.SGD(model.parameters(), lr=config.learning_rate,
                              momentum=config.momentum, weight_decay=config.weight_decay)
        anchor = proximal_anchor(model, config.proximal_mu)  # FedProx; {} when mu is 0
        gen = torch.Generator().manual_seed(seed)
        model.train()
        total, correct = 0.0, 0
        for _ in range(config.local_epochs):
            for idx in torch.randperm(len(y), generator=gen).split(config.batch_size):
                out = model(x[idx])
                loss = nn.functional.cross_entropy(out, y[idx])
                if anchor:
                    loss = loss + proximal_term(model, anchor, config.proximal_mu)
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += loss.item() * len(idx)
                correct += int((out.argmax(dim=1) == y[idx]).sum())
        seen = len(y) * config.local_epochs
        return len(y), {"train_loss": total / seen, "train_accuracy": correct / seen}

    def evaluate(self, model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]):
        x, y = data
        model.eval()
        with torch.no_grad():
            out = model(x)
            loss = nn.functional.cross_entropy(out, y)
        return {"accuracy": float((out.argmax(dim=1) == y).float().mean()), "loss": float(loss)}
