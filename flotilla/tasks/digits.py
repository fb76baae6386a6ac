"""The reference task: an MLP on scikit-learn's 8x8 handwritten digits.

The data ships with scikit-learn (1,797 real images), so demos, tests and simulations run
offline in seconds. A fixed stratified 20% is the server's held-out split; the rest is dealt
to devices with Dirichlet label skew, the usual non-IID benchmark for federated averaging.
Everything is derived from explicit seeds and private generators, never global RNG state.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from flotilla.tasks.base import Examples, LocalData, Shard, proximal_anchor, proximal_term

if TYPE_CHECKING:
    from flotilla.core.spec import DataSection, TrainSection

#: Seed of the held-out split; fixed so every server evaluates on the same images.
HELDOUT_SEED = 20240601
HELDOUT_FRACTION = 0.2
#: Share of each shard held back from training as the device's own validation split
#: (``data.params.val_fraction``; 0 trains on the whole shard and reports no local scores).
VAL_FRACTION = 0.1
#: Fewest examples a shard may get; the partition is redrawn until all shards have this many.
MIN_SHARD_SIZE = 10
MAX_PARTITION_DRAWS = 10_000
NUM_CLASSES = 10
HIDDEN = (256, 128)


def dirichlet_partition(
    labels: np.ndarray, count: int, alpha: float, seed: int, min_size: int = MIN_SHARD_SIZE
) -> list[np.ndarray]:
    """Split positions ``0..len(labels)`` into ``count`` disjoint label-skewed shards.

    Each class is divided by proportions drawn from Dir(alpha); draws repeat (from the same
    generator, so deterministically) until every shard holds at least ``min_size`` examples.
    """
    if count < 1:
        raise ValueError(f"shard count must be >= 1, got {count}")
    if not alpha > 0 or not math.isfinite(alpha):
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
    if count * min_size > len(labels):
        raise ValueError(
            f"{len(labels)} examples cannot fill {count} shards of at least {min_size} each"
        )
    rng = np.random.default_rng(seed % 2**64)  # any int spec seed, negative included
    classes = np.unique(labels)
    for _ in range(MAX_PARTITION_DRAWS):
        parts: list[list[np.ndarray]] = [[] for _ in range(count)]
        for c in classes:
            members = rng.permutation(np.flatnonzero(labels == c))
            shares = rng.dirichlet(np.full(count, alpha))
            shares = np.nan_to_num(shares, nan=1.0 / count)  # tiny alpha can underflow
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(np.int64)
            for i, piece in enumerate(np.split(members, cuts)):
                parts[i].append(piece)
        shards = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(s) for s in shards) >= min_size:
            return shards
    raise ValueError(
        f"no Dirichlet(alpha={alpha}) split of {len(labels)} examples into {count} shards "
        f"gave every shard {min_size} examples after {MAX_PARTITION_DRAWS} draws; "
        "use fewer shards or a larger alpha"
    )


class DigitsMLP(nn.Module):
    """Two-hidden-layer ReLU MLP over the 64 pixels in [0, 1].

    Pixels are recentred to [-1, 1] inside the model (no parameters, so nothing extra on the
    wire); zero-mean inputs make the few local steps of each round count for much more.
    """

    def __init__(self, hidden: tuple[int, ...] = HIDDEN) -> None:
        super().__init__()
        widths = (64, *hidden)
        layers: list[nn.Module] = []
        for d_in, d_out in itertools.pairwise(widths):
            layers += [nn.Linear(d_in, d_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], NUM_CLASSES))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x * 2.0 - 1.0)  # type: ignore[no-any-return]


class DigitsTrainingStep(nn.Module):
    """The digits model and its loss as one module: what an exported training program runs.

    Returns the batch's mean cross-entropy (the loss :meth:`DigitsTask.train` minimises) and
    the predicted labels, so a device can count its training accuracy too.
    """

    #: Names of :meth:`forward`'s outputs, for the exported program's manifest.
    output_names = ("loss", "predictions")

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(x)
        loss = nn.functional.cross_entropy(logits, y)
        return loss, logits.detach().argmax(dim=1)


@dataclass(frozen=True, slots=True)
class AugmentParams:
    """``data.params`` of the digits task."""

    #: Give each device augmented copies of real images instead of a slice of the pool.
    augment: bool = False
    min_samples: int = 20
    max_samples: int = 100
    #: Largest rotation (degrees) and shift (pixels) either way; noise std on [0, 1] pixels.
    max_rotation: float = 15.0
    max_shift: float = 1.0
    noise: float = 0.05
    #: ``random``: each shard's Dirichlet(alpha) label mix is drawn independently;
    #: ``by_index``: its largest share goes to label ``index * 10 // count``, so the data
    #: follows the shard index (with ``population.speed_order = "ascending"``: slow
    #: devices hold different labels than fast ones).
    label_skew: str = "random"
    #: How shard sizes spread over ``min..max_samples``: ``uniform`` or ``loguniform``
    #: (most shards small, a few large, as data on real devices is).
    size_dist: str = "uniform"
    #: Share of each shard held back for the device's local validation (0: none).
    val_fraction: float = VAL_FRACTION
    #: Correlation (-1..1) of a shard's size with its index; with
    #: ``population.speed_order = "ascending"`` (device 0 the slowest) a negative value
    #: gives slower devices larger shards.
    size_skew: float = 0.0

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> AugmentParams:
        from flotilla.core.tables import build_dataclass

        made = build_dataclass(cls, params, "digits task", "data.params.")
        if not 2 <= made.min_samples <= made.max_samples:
            raise ValueError("data.params: need 2 <= min_samples <= max_samples")
        if made.label_skew not in ("random", "by_index"):
            raise ValueError("data.params.label_skew must be random or by_index")
        if made.size_dist not in ("uniform", "loguniform"):
            raise ValueError("data.params.size_dist must be uniform or loguniform")
        if not -1.0 <= made.size_skew <= 1.0:
            raise ValueError("data.params.size_skew must be in [-1, 1]")
        if not 0.0 <= made.val_fraction < 1.0:
            raise ValueError("data.params.val_fraction must be in [0, 1)")
        return made

    def val_count(self, n: int) -> int:
        """Examples of ``n`` held back for validation: at least one unless the fraction
        is 0, and never all of them."""
        if self.val_fraction == 0.0 or n < 2:
            return 0
        return min(n - 1, max(1, round(self.val_fraction * n)))

    def shard_size(self, shard: Shard, rng: np.random.Generator) -> int:
        """Samples of ``shard``: a quantile of the size distribution drawn from a Gaussian
        copula, so ``size_skew`` correlates it with the shard's index whatever the spread."""
        if self.size_dist == "uniform" and self.size_skew == 0.0:
            return int(rng.integers(self.min_samples, self.max_samples + 1))
        normal = NormalDist()
        rank = normal.inv_cdf((shard.index + 0.5) / shard.count)
        own = float(rng.standard_normal())
        q = normal.cdf(self.size_skew * rank + math.sqrt(1.0 - self.size_skew**2) * own)
        lo, hi = self.min_samples, self.max_samples + 1
        if self.size_dist == "loguniform":
            return min(int(math.exp(math.log(lo) + q * (math.log(hi) - math.log(lo)))), hi - 1)
        return min(lo + int(q * (hi - lo)), hi - 1)


def augment_digits(images: np.ndarray, rng: np.random.Generator, p: AugmentParams) -> np.ndarray:
    """Rotate, shift and noise 8x8 images (rows of 64 in [0, 1]); bilinear, zero outside."""
    n = len(images)
    grid = images.reshape(n, 8, 8)
    theta = np.deg2rad(rng.uniform(-p.max_rotation, p.max_rotation, size=(n, 1, 1)))
    shift = rng.uniform(-p.max_shift, p.max_shift, size=(2, n, 1, 1))
    rows, cols = np.meshgrid(np.arange(8.0), np.arange(8.0), indexing="ij")
    u, v = cols - 3.5 - shift[0], rows - 3.5 - shift[1]
    # Each output pixel reads the source point that the rotation brings onto it.
    src_c = np.cos(theta) * u + np.sin(theta) * v + 3.5
    src_r = -np.sin(theta) * u + np.cos(theta) * v + 3.5
    r0, c0 = np.floor(src_r).astype(np.int64), np.floor(src_c).astype(np.int64)
    fr, fc = src_r - r0, src_c - c0
    out = np.zeros_like(grid)
    batch = np.arange(n)[:, None, None]
    for dr, dc, w in ((0, 0, (1 - fr) * (1 - fc)), (0, 1, (1 - fr) * fc),
                      (1, 0, fr * (1 - fc)), (1, 1, fr * fc)):  # fmt: skip
        rr, cc = r0 + dr, c0 + dc
        inside = (rr >= 0) & (rr < 8) & (cc >= 0) & (cc < 8)
        out += w * inside * grid[batch, np.clip(rr, 0, 7), np.clip(cc, 0, 7)]
    out += rng.normal(0.0, p.noise, size=out.shape)
    return np.clip(out, 0.0, 1.0).reshape(n, 64).astype(np.float32)


class DigitsTask:
    """MLP classifier on ``sklearn.datasets.load_digits``; implements :class:`Task`.

    Each device trains on its shard less ``data.params.val_fraction`` (10 %), which it
    keeps as its own validation split (:class:`LocalData`); a task copied from this one
    inherits that, and ``val_fraction = 0`` trains on the whole shard."""

    #: Widths of the hidden layers.
    hidden: tuple[int, ...] = HIDDEN
    #: Batches of each epoch in a fresh seeded random order; False takes them in the
    #: shard's own order (the simulator's batched trainer reads this too).
    shuffle_batches: bool = True

    def __init__(self) -> None:
        self._split: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._partitions: dict[tuple[int, float, int], list[np.ndarray]] = {}

    def _data(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Pool and held-out arrays, loaded once per task instance."""
        if self._split is None:
            from sklearn.datasets import load_digits
            from sklearn.model_selection import train_test_split

            digits = load_digits()
            x = (digits.data / 16.0).astype(np.float32)
            y = digits.target.astype(np.int64)
            x_pool, x_held, y_pool, y_held = train_test_split(
                x, y, test_size=HELDOUT_FRACTION, stratify=y, random_state=HELDOUT_SEED
            )
            self._split = (x_pool, y_pool, x_held, y_held)
        return self._split

    def build_model(self, seed: int) -> nn.Module:
        # Built on the meta device and filled from a private generator: the global RNG is
        # neither consumed nor needed for reproducibility.
        with torch.device("meta"):
            model = DigitsMLP(self.hidden)
        model = model.to_empty(device="cpu")
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in model.modules():
                if isinstance(layer, nn.Linear):
                    # He-uniform weights: PyTorch's default range is ~2.4x narrower and
                    # learns too slowly for 20 short non-IID FedAvg rounds.
                    fan_in = layer.in_features
                    w_bound, b_bound = math.sqrt(6 / fan_in), 1 / math.sqrt(fan_in)
                    layer.weight.uniform_(-w_bound, w_bound, generator=gen)
                    layer.bias.uniform_(-b_bound, b_bound, generator=gen)
        return model

    def load_shard(self, shard: Shard, data: DataSection) -> LocalData:
        augment = AugmentParams.from_params(data.params)
        if augment.augment:
            return self._augmented_shard(shard, data, augment)
        x_pool, y_pool, _, _ = self._data()
        key = (shard.count, data.alpha, data.seed)
        if key not in self._partitions:  # the same split serves every shard of a fleet
            self._partitions = {key: dirichlet_partition(y_pool, *key)}
        mine = self._partitions[key][shard.index]
        rng = np.random.default_rng([data.seed % 2**64, shard.count, shard.index])
        order = rng.permutation(mine)
        n_val = augment.val_count(len(order))
        val, train = order[:n_val], order[n_val:]
        return LocalData(train=_tensors(x_pool, y_pool, train), val=_tensors(x_pool, y_pool, val))

    def train_samples(self, shard: Shard, data: DataSection) -> int:
        """Training samples :meth:`load_shard` would give ``shard``, without building it
        when the shard is augmented (the simulator needs every device's count at the
        start, its images only when it trains)."""
        augment = AugmentParams.from_params(data.params)
        if not augment.augment:
            return self.load_shard(shard, data).num_train
        rng = np.random.default_rng([data.seed % 2**64, shard.count, shard.index, 1])
        n = augment.shard_size(shard, rng)
        return n - augment.val_count(n)

    def _augmented_shard(self, shard: Shard, data: DataSection, p: AugmentParams) -> LocalData:
        """A shard for fleets larger than the 1,437 pool images allow: ``min..max_samples``
        examples with Dirichlet(alpha) label skew, each a real pool image of its label,
        shifted, rotated and noised. The held-out split is never touched."""
        x_pool, y_pool, _, _ = self._data()
        rng = np.random.default_rng([data.seed % 2**64, shard.count, shard.index, 1])
        n = p.shard_size(shard, rng)
        mix = np.nan_to_num(rng.dirichlet(np.full(NUM_CLASSES, data.alpha)), nan=0.1)
        if p.label_skew == "by_index":
            dominant = shard.index * NUM_CLASSES // shard.count
            others = rng.permutation([c for c in range(NUM_CLASSES) if c != dominant])
            ranked = np.sort(mix)[::-1]
            mix = np.empty(NUM_CLASSES)
            mix[dominant], mix[others] = ranked[0], ranked[1:]
        labels = rng.choice(NUM_CLASSES, size=n, p=mix / mix.sum())
        source = np.empty(n, dtype=np.int64)
        for c in range(NUM_CLASSES):
            where = np.flatnonzero(labels == c)
            members = np.flatnonzero(y_pool == c)
            source[where] = members[rng.integers(len(members), size=len(where))]
        images = augment_digits(x_pool[source], rng, p)
        n_val = p.val_count(n)
        val, train = np.arange(n_val), np.arange(n_val, n)
        return LocalData(train=_tensors(images, labels, train), val=_tensors(images, labels, val))

    def example_losses(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-example cross-entropy. ``train`` is plain minibatch SGD on its mean, so the
        simulator may train many clients at once (see flotilla.simulation.training)."""
        return nn.functional.cross_entropy(outputs, targets, reduction="none")

    def load_path(self, path: Path, data: DataSection) -> LocalData:
        """A device's own digits from ``--data FILE.npz``: ``x`` (N, 64) in [0, 1], ``y`` (N,)."""
        try:
            with np.load(path, allow_pickle=False) as archive:
                x = np.asarray(archive["x"], dtype=np.float32)
                y = np.asarray(archive["y"], dtype=np.int64)
        except (OSError, KeyError, ValueError) as exc:
            raise ValueError(
                f"{path}: expected an .npz with arrays x (N, 64) and y (N,): {exc}"
            ) from exc
        if x.ndim != 2 or x.shape[1] != 64 or y.shape != (x.shape[0],) or len(y) < 2:
            raise ValueError(f"{path}: x must be (N, 64) and y (N,), got {x.shape} and {y.shape}")
        if not np.isfinite(x).all() or y.min() < 0 or y.max() >= NUM_CLASSES:
            raise ValueError(f"{path}: x must be finite and labels in 0..{NUM_CLASSES - 1}")
        order = np.random.default_rng(data.seed % 2**64).permutation(len(y))
        n_val = AugmentParams.from_params(data.params).val_count(len(order))
        val, train = order[:n_val], order[n_val:]
        return LocalData(train=_tensors(x, y, train), val=_tensors(x, y, val))

    def training_module(self, model: nn.Module) -> nn.Module:
        """:class:`ExportableTask`: the model with its loss, for on-device training."""
        return DigitsTrainingStep(model)

    def example_batch(self, batch_size: int) -> Examples:
        """:class:`ExportableTask`: ``batch_size`` blank images (pixels in [0, 1]) and labels."""
        return torch.zeros(batch_size, 64), torch.zeros(batch_size, dtype=torch.int64)

    def heldout(self) -> Examples:
        _, _, x_held, y_held = self._data()
        return torch.from_numpy(x_held.copy()), torch.from_numpy(y_held.copy())

    def train(
        self, model: nn.Module, data: LocalData, config: TrainSection, seed: int
    ) -> tuple[int, dict[str, float]]:
        x, y = data.train
        n = int(y.shape[0])
        opt = torch.optim.SGD(
            model.parameters(),
            lr=config.learning_rate,
            momentum=config.momentum,
            weight_decay=config.weight_decay,
        )
        gen = torch.Generator().manual_seed(seed)
        loss_fn = nn.CrossEntropyLoss()
        anchor = proximal_anchor(model, config.proximal_mu)
        model.train()
        total_loss, correct, seen = 0.0, 0, 0
        for _ in range(config.local_epochs):
            order = torch.randperm(n, generator=gen) if self.shuffle_batches else torch.arange(n)
            for start in range(0, n, config.batch_size):
                idx = order[start : start + config.batch_size]
                logits = model(x[idx])
                loss = loss_fn(logits, y[idx])
                if anchor:
                    loss = loss + proximal_term(model, anchor, config.proximal_mu)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total_loss += float(loss.detach()) * len(idx)
                correct += int((logits.detach().argmax(dim=1) == y[idx]).sum())
                seen += len(idx)
        metrics = {
            "train_loss": total_loss / max(seen, 1),
            "train_accuracy": correct / max(seen, 1),
        }
        return n, metrics

    def evaluate(self, model: nn.Module, data: Examples) -> dict[str, float]:
        x, y = data
        model.eval()
        with torch.no_grad():
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y) if len(y) else torch.tensor(0.0)
            hits = (logits.argmax(dim=1) == y).float()
            acc = hits.mean() if len(y) else torch.tensor(0.0)
            # Per-class accuracy over the classes present: a selector that never picks the
            # devices holding some label can keep mean accuracy high and this one low.
            counts = torch.bincount(y, minlength=NUM_CLASSES)
            per_class = torch.bincount(y, weights=hits, minlength=NUM_CLASSES)
            present = counts > 0
            worst = (per_class[present] / counts[present]).min() if len(y) else acc
        return {
            "accuracy": float(acc),
            "loss": float(loss),
            "num_samples": float(len(y)),
            "worst_class_accuracy": float(worst),
        }


def _tensors(x: np.ndarray, y: np.ndarray, positions: np.ndarray) -> Examples:
    """Owned tensors for the chosen rows (fancy indexing copies, so no aliasing)."""
    return torch.from_numpy(x[positions]), torch.from_numpy(y[positions])


class WideDigitsTask(DigitsTask):
    """The digits task with a ~12x larger MLP (64-1024-512-10, 596k parameters): the same
    learning problem, but bound by transfer on slow links (for scheduling studies)."""

    hidden = (1024, 512)
