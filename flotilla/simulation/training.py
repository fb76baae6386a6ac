"""Local training of many virtual clients: vectorized where the task allows, else a loop.

A task is *batchable* when it has ``example_losses(outputs, targets)`` (per-example loss,
no reduction) and a model without buffers: it then promises that its ``train`` is plain
minibatch SGD on that loss (momentum, weight decay, FedProx term; batches in the order of
``torch.randperm(n, generator=torch.Generator().manual_seed(seed))`` each epoch, one
generator for all epochs, or in the shard's own order when the task says
``shuffle_batches = False``) and that it is a classifier (``evaluate`` reports
``accuracy`` and mean ``loss``). Such clients train
in groups as one computation (``torch.func.functional_call`` under ``vmap``), each client
with its own parameters, optimizer state and batch order; a client with fewer samples
has its missing examples masked out, never padded with fake data. Both paths give the
same parameters (to float rounding) and the same metrics.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import numpy as np

from flotilla.core.spec import DataSection, TrainSection
from flotilla.core.tensors import FlatState, ModelState, TensorSpec
from flotilla.simulation.allocator import keep_freed_memory

if TYPE_CHECKING:
    from flotilla.simulation.stacked import Outer

#: Memory a batched group works in on a CPU: small enough that a group's parameters,
#: gradients and batches stay in the caches (measured on Flower's MLP and the digits MLP:
#: groups of 16-64 clients beat groups of 750 by 1.3-1.4x). A CUDA device uses half of
#: what is free: there, the larger the group the better.
CPU_GROUP_BYTES = 64 * 1024**2
#: Client data a trainer keeps loaded (the first shards loaded; others load when used).
SHARD_CACHE_BYTES = 256 * 1024**2
#: One batch of a group: (params, inputs, labels, mask) -> (gradients by name, (summed
#: loss, correct predictions) per client).
Step: TypeAlias = Callable[..., tuple[dict[str, Any], tuple[Any, Any]]]
#: The ways a batched trainer computes a group, in the order it prefers them.
PATHS = ("stacked", "vmap", "loop")
#: Clients of the first call each way trains in the probe (the first ones).
PROBE_CLIENTS = 128
#: Of those, how many are checked against the task's own ``train`` (and time the loop).
PROBE_CHECKED = 16
#: How much faster a later way of :data:`PATHS` must be to be chosen over an earlier one.
PROBE_SPEEDUP = 1.25


@dataclass(slots=True)
class ClientResult:
    num_samples: int
    metrics: dict[str, float]
    #: Local model minus the global one, float32.
    delta: ModelState


class ClientTrainer(Protocol):
    """Trains the given clients from one global model; results in the order given."""

    shards: ShardCache

    def train(
        self,
        global_state: ModelState,
        clients: Sequence[int],
        train: TrainSection,
        data: DataSection,
        seed: int,
    ) -> list[ClientResult]: ...


class ShardCache:
    """Each client's data: client ``i`` of ``count`` holds shard ``i/count``.

    Shards are kept as they are first loaded, up to ``max_bytes`` of tensors; beyond that
    a shard is loaded again each time it is asked for (tasks derive them from seeds), so
    memory stays flat however many clients there are. Keeping the first ones rather than
    the most recent is what helps a round that goes through every client in the same
    order (least-recently-used would then never hit). Each client's count of training
    samples is kept apart, for good."""

    def __init__(self, task: Any, count: int, max_bytes: int = SHARD_CACHE_BYTES) -> None:
        self.task = task
        self.count = count
        self.max_bytes = max_bytes
        self._shards: dict[tuple[str, int], Any] = {}
        self._bytes = 0
        self._num_train: dict[tuple[str, int], int] = {}
        self._last: tuple[DataSection, str] | None = None

    def _key(self, data: DataSection, client: int) -> tuple[str, int]:
        if self._last is None or self._last[0] is not data:  # one section serves a round
            self._last = (data, data.key())
        return self._last[1], client

    def get(self, data: DataSection, client: int) -> Any:
        from flotilla.tasks import Shard

        key = self._key(data, client)
        held = self._shards.get(key)
        if held is not None:
            return held
        shard = self.task.load_shard(Shard(client, self.count), data)
        self._num_train[key] = int(shard.num_train)
        size = _nbytes(shard)
        if self._bytes + size <= self.max_bytes:
            self._shards[key] = shard
            self._bytes += size
        return shard

    def num_train(self, data: DataSection, client: int) -> int:
        """Training samples of a client's shard, without keeping the shard when the task
        can tell (``train_samples(shard, data)``, optional): every client's count is
        needed at the start, its data only when it trains."""
        from flotilla.tasks import Shard

        key = self._key(data, client)
        known = self._num_train.get(key)
        if known is not None:
            return known
        count = getattr(self.task, "train_samples", None)
        if callable(count):
            self._num_train[key] = known = int(count(Shard(client, self.count), data))
            return known
        return int(self.get(data, client).num_train)


def _nbytes(shard: Any) -> int:
    """Bytes of a shard's tensors (train and validation)."""
    return sum(
        int(t.element_size() * t.nelement()) for part in (shard.train, shard.val) for t in part
    )


def is_batchable(task: Any) -> bool:
    if not callable(getattr(task, "example_losses", None)):
        return False
    model = task.build_model(0)
    return not any(True for _ in model.buffers())


class LoopTrainer:
    """One client after another through the task's own ``train``, on one reused model."""

    def __init__(self, task: Any, shards: ShardCache) -> None:
        self.task = task
        self.shards = shards
        self._model: Any = None

    def train(
        self,
        global_state: ModelState,
        clients: Sequence[int],
        train: TrainSection,
        data: DataSection,
        seed: int,
    ) -> list[ClientResult]:
        from flotilla.tasks import load_model_state, model_state

        if self._model is None:
            self._model = self.task.build_model(0)
        model = self._model
        out = []
        for client in clients:
            local = self.shards.get(data, client)
            load_model_state(model, global_state)
            num_samples, metrics = self.task.train(model, local, train, seed)
            if local.num_val:
                metrics = {**metrics, **self.task.evaluate(model, local.val)}
            state = model_state(model)
            delta = {k: state[k] - np.asarray(global_state[k]) for k in global_state}
            out.append(ClientResult(int(num_samples), _floats(metrics), delta))
        return out


class BatchedTrainer:
    """Clients in groups, each group one vectorized computation (see the module doc).

    Two ways to compute a group: ``stacked`` (linear layers as batched matrix products
    with autograd, :mod:`flotilla.simulation.stacked`; models whose parameters are all
    linear layers') and ``vmap`` (``torch.func`` over any batchable model). The first
    call trains its first clients every way it may (``paths``), checks each against the
    task's own ``train`` and keeps the fastest that agrees: a measured choice, not a
    rule. ``loop`` among ``paths`` lets it choose the task's own per-client loop when that
    is faster, or when no batched way agrees (a model that mixes the examples of a
    batch, say, which padding a short batch would change).
    """

    def __init__(
        self,
        task: Any,
        shards: ShardCache,
        device: str = "cpu",
        group_bytes: int | None = None,
        paths: Sequence[str] = ("stacked", "vmap"),
    ) -> None:
        import torch

        from flotilla.simulation.stacked import stack_model

        unknown = set(paths) - set(PATHS)
        if unknown or not paths:
            raise ValueError(f"paths must be some of {PATHS}, got {list(paths)}")
        self.task = task
        self.shards = shards
        self.device = torch.device(device)
        self._model = task.build_model(0).to(self.device)
        self._stacked = stack_model(self._model) if "stacked" in paths else None
        self.paths = tuple(p for p in PATHS if p in paths and (p != "stacked" or self._stacked))
        self._group_bytes = group_bytes
        self._loop = LoopTrainer(task, shards)
        #: The chosen way; None until the first call decides.
        self.choice: str | None = None
        #: Seconds per client each way took in the probe (those that agreed).
        self.probe: dict[str, float] = {}

    @property
    def kind(self) -> set[str]:
        return set() if self.choice is None else {self.choice}

    def group_size(self, train: TrainSection, params: int, features: int) -> int:
        """Most clients per group: what fits the memory budget (parameters, gradients,
        momentum, a temporary per parameter, and a batch of activations per client)."""
        import torch

        budget = self._group_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = free // 2
            else:
                budget = CPU_GROUP_BYTES
        per_client = 4 * (5 * params + 8 * train.batch_size * max(features, 1))
        return max(1, int(budget // per_client))

    def train(
        self,
        global_state: ModelState,
        clients: Sequence[int],
        train: TrainSection,
        data: DataSection,
        seed: int,
    ) -> list[ClientResult]:
        if not clients:
            return []
        if train.params:
            # Task parameters can change how the task trains, which the batched recipe
            # would not know: the task's own loop is the faithful path.
            return self._loop.train(global_state, clients, train, data, seed)
        locals_ = [self.shards.get(data, c) for c in clients]
        params = sum(int(np.prod(v.shape)) for v in global_state.values())
        features = int(np.prod(locals_[0].train[0].shape[1:]))
        size = self.group_size(train, params, features)
        base = self._base(global_state)
        if self.choice is None:
            self.choice = self._choose(
                global_state, base, clients, locals_, train, data, seed, size
            )
        path = self.choice
        if path == "loop":
            return self._loop.train(global_state, clients, train, data, seed)
        out: list[ClientResult] = []
        for start in range(0, len(locals_), size):
            out += self._group(base, locals_[start : start + size], train, seed, path)
        return out

    def _base(self, global_state: ModelState) -> dict[str, Any]:
        """The global model as tensors on this trainer's device, once per call."""
        import torch

        return {
            n: torch.from_numpy(np.array(v, dtype=np.float32)).to(self.device)
            for n, v in global_state.items()
        }

    def _choose(
        self,
        global_state: ModelState,
        base: dict[str, Any],
        clients: Sequence[int],
        locals_: list[Any],
        train: TrainSection,
        data: DataSection,
        seed: int,
        size: int,
    ) -> str:
        """Time each way on the first clients; keep the fastest that gives the task's own
        results, preferring the earlier of ``PATHS`` unless a later one is clearly faster
        (so that a run makes the same choice, and gives the same numbers, again)."""
        probe = locals_[:PROBE_CLIENTS]
        checked = min(len(probe), PROBE_CHECKED)
        self._loop.train(global_state, clients[:1], train, data, seed)  # warm-up
        start = time.perf_counter()
        reference = self._loop.train(global_state, clients[:checked], train, data, seed)
        timings = {"loop": (time.perf_counter() - start) / checked}
        for path in self.paths:
            if path == "loop":
                continue
            try:
                self._group(base, probe[:2], train, seed, path)  # warm-up
                start = time.perf_counter()
                got = []
                for first in range(0, len(probe), size):
                    got += self._group(base, probe[first : first + size], train, seed, path)
                seconds = (time.perf_counter() - start) / len(probe)
            except Exception:  # a way this model cannot take is simply not chosen
                continue
            if _agree(got[:checked], reference):
                timings[path] = seconds
        self.probe = timings
        best, best_s = "loop", math.inf
        for path in self.paths:  # a later way must be clearly faster than an earlier one
            if path in timings and timings[path] * PROBE_SPEEDUP < best_s:
                best, best_s = path, timings[path]
        return best

    def _group(
        self,
        base: dict[str, Any],
        locals_: list[Any],
        cfg: TrainSection,
        seed: int,
        path: str,
    ) -> list[ClientResult]:
        import torch

        from flotilla.simulation.stacked import Outer

        dev = self.device
        count = len(locals_)
        x_train, y_train, counts = _stack([d.train for d in locals_], dev)
        shuffle = bool(getattr(self.task, "shuffle_batches", True))
        index, mask = _schedule(counts, cfg.batch_size, cfg.local_epochs, seed, shuffle, dev)
        names = list(base)
        # Each parameter contiguous per client, as batched matrix products want them.
        params = {n: base[n].expand(count, *base[n].shape).clone() for n in names}
        step = self._stacked_step(base, cfg) if path == "stacked" else self._vmap_step(base, cfg)
        bufs: dict[str, torch.Tensor] = {}
        loss_sum = torch.zeros(count, device=dev)
        correct = torch.zeros(count, device=dev)
        lr, momentum, decay = cfg.learning_rate, cfg.momentum, cfg.weight_decay
        # A step is as wide as its fullest client's batch: a short last batch (45 samples
        # in batches of 32 end with 13) is not computed at full width for everyone.
        widths = mask.sum(dim=2).max(dim=0).values.long().tolist()
        for t in range(index.shape[1]):
            width = max(1, widths[t])
            idx, m = index[:, t, :width], mask[:, t, :width]
            grads, (batch_loss, batch_correct) = step(
                params, _rows(x_train, idx), _rows(y_train, idx), m
            )
            loss_sum += batch_loss
            correct += batch_correct
            active = m.sum(dim=1) > 0
            # Every client with data takes its first batch at t = 0 and drops out for good
            # once it has none left: the active set only shrinks. When it is everyone,
            # update in place; else only the active rows (torch.optim.SGD's arithmetic).
            rows_on = None if bool(active.all()) else active.nonzero().squeeze(1)
            for n in names:
                p, g = params[n], grads[n]
                if rows_on is None:
                    bufs[n] = _sgd(p, g, bufs.get(n), t == 0, lr, momentum, decay)
                    continue
                p = p[rows_on]
                g = g.take(rows_on) if isinstance(g, Outer) else g[rows_on]
                buf = None if t == 0 or not momentum else bufs[n][rows_on]
                buf = _sgd(p, g, buf, t == 0, lr, momentum, decay)
                params[n][rows_on] = p
                if momentum:
                    if t == 0:
                        bufs[n] = torch.zeros_like(params[n])
                    bufs[n][rows_on] = buf
        seen = counts.clamp(min=1).float() * cfg.local_epochs
        trained = {"train_loss": loss_sum / seen, "train_accuracy": correct / seen}
        # A client with no validation examples reports no validation scores (LocalData).
        has_val = [d.num_val > 0 for d in locals_]
        vals = [d.val for d in locals_]
        scored = self._evaluate(params, vals, path) if any(has_val) else {}
        # All of a client's deltas in one row: handed out back to back in one buffer,
        # which the aggregator folds in one pass per client.
        flat = torch.empty((count, sum(base[n].numel() for n in names)), device=dev)
        offset = 0
        for n in names:
            size = base[n].numel()
            torch.sub(
                params[n].reshape(count, size),
                base[n].reshape(size),
                out=flat[:, offset : offset + size],
            )
            offset += size
        rows_np = flat.cpu().numpy()
        train_cols = {k: v.cpu().numpy().tolist() for k, v in trained.items()}
        val_cols = {k: v.cpu().numpy().tolist() for k, v in scored.items()}
        layout = tuple(TensorSpec(n, "F32", tuple(base[n].shape)) for n in names)
        return [
            ClientResult(
                int(counts[i]),
                {k: v[i] for k, v in (train_cols | val_cols if has_val[i] else train_cols).items()},
                FlatState(rows_np[i], layout),
            )
            for i in range(count)
        ]

    def _vmap_step(self, base: dict[str, Any], cfg: TrainSection) -> Step:
        """One batch's gradients per client by ``vmap(grad(loss))``, with the batch's
        summed loss and correct predictions per client."""
        import torch
        from torch.func import functional_call, grad, vmap

        model, losses_of, mu = self._model, self.task.example_losses, cfg.proximal_mu

        def loss_fn(
            p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, m: torch.Tensor
        ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
            out = functional_call(model, p, (x,))
            seen = m.sum()
            loss = (losses_of(out, y) * m).sum() / seen.clamp(min=1.0)
            if mu > 0:
                prox = sum(((p[n] - base[n]) ** 2).sum() for n in base)
                loss = loss + 0.5 * mu * prox
            correct = ((out.argmax(dim=-1) == y).float() * m).sum()
            return loss, (loss.detach() * seen, correct)

        stepped: Step = vmap(grad(loss_fn, has_aux=True))
        return stepped

    def _stacked_step(self, base: dict[str, Any], cfg: TrainSection) -> Step:
        """The same as :meth:`_vmap_step` through the stacked model and plain autograd:
        every client's loss is its own, so one backward pass over their sum gives each
        client its own gradient."""
        import torch

        stacked, losses_of, mu = self._stacked, self.task.example_losses, cfg.proximal_mu
        assert stacked is not None
        names = list(base)

        def step(
            params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, m: torch.Tensor
        ) -> tuple[dict[str, torch.Tensor | Outer], tuple[torch.Tensor, torch.Tensor]]:
            leaves = {n: params[n].detach().requires_grad_() for n in names}
            # Without a proximal term the layers' own backward passes give every gradient:
            # the weights' stay factored, for the update to fold in (_sgd).
            deferred = mu == 0
            stacked.bind(leaves, deferred=deferred)
            loss, correct, seen = _masked_scores(losses_of, stacked(x), y, m)
            if deferred:
                loss.sum().backward()
                return stacked.deferred_grads(), (loss.detach() * seen, correct)
            prox = sum(((leaves[n] - base[n]) ** 2).flatten(1).sum(dim=1) for n in names)
            loss = loss + 0.5 * mu * prox
            grads = torch.autograd.grad(loss.sum(), [leaves[n] for n in names])
            return dict(zip(names, grads, strict=True)), (loss.detach() * seen, correct)

        return step

    def _evaluate(self, params: dict[str, Any], vals: list[Any], path: str) -> dict[str, Any]:
        import torch
        from torch.func import functional_call, vmap

        x, y, counts = _stack(vals, self.device)
        mask = (
            torch.arange(x.shape[1], device=self.device).unsqueeze(0) < counts.unsqueeze(1)
        ).float()
        losses_of, model = self.task.example_losses, self._model
        with torch.no_grad():
            if path == "stacked" and self._stacked is not None:
                self._stacked.bind(params)
                loss, correct, seen = _masked_scores(losses_of, self._stacked(x), y, mask)
                acc = correct / seen.clamp(min=1.0)
            else:

                def score(
                    p: dict[str, torch.Tensor], xs: torch.Tensor, ys: torch.Tensor, m: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
                    out = functional_call(model, p, (xs,))
                    seen = m.sum().clamp(min=1.0)
                    loss = (losses_of(out, ys) * m).sum() / seen
                    acc = ((out.argmax(dim=-1) == ys).float() * m).sum() / seen
                    return loss, acc

                loss, acc = vmap(score)(params, x, y, mask)
        return {"loss": loss, "accuracy": acc, "num_samples": counts.float()}


def _sgd(p: Any, g: Any, buf: Any, first: bool, lr: float, momentum: float, decay: float) -> Any:
    """One ``torch.optim.SGD`` step of stacked parameters ``p`` in place (dampening 0, no
    Nesterov); the momentum buffer after it (None without momentum). A weight gradient
    given as :class:`Outer` factors is folded in by one ``baddbmm_``, never written out."""
    import torch

    from flotilla.simulation.stacked import Outer

    if isinstance(g, Outer):
        a, b = g.grad_out.transpose(1, 2), g.x
        if not momentum:
            p.baddbmm_(a, b, beta=1.0 - lr * decay, alpha=-lr)
            return None
        if first:
            buf = torch.baddbmm(p, a, b, beta=decay)  # g + decay * p
        else:
            buf.baddbmm_(a, b, beta=momentum)
            if decay:
                buf.add_(p, alpha=decay)
        p.add_(buf, alpha=-lr)
        return buf
    if decay:
        g.add_(p, alpha=decay)
    if momentum:
        buf = g if first else buf.mul_(momentum).add_(g)
        g = buf
    p.add_(g, alpha=-lr)
    return buf if momentum else None


def _masked_scores(losses_of: Any, out: Any, y: Any, m: Any) -> tuple[Any, Any, Any]:
    """Per client of a stacked batch (``out``: clients x batch x ...): the mean loss over
    its real examples (``m`` marks them), its correct predictions, and how many were real."""
    seen = m.sum(dim=1)
    per = losses_of(out.flatten(0, 1), y.flatten(0, 1)).view(m.shape) * m
    loss = per.sum(dim=1) / seen.clamp(min=1.0)
    correct = ((out.detach().argmax(dim=-1) == y).float() * m).sum(dim=1)
    return loss, correct, seen


def _agree(got: list[ClientResult], reference: list[ClientResult]) -> bool:
    """Whether a way's deltas are the task's own, to float rounding."""
    for a, b in zip(got, reference, strict=True):
        if a.num_samples != b.num_samples:
            return False
        for name in b.delta:
            want = np.asarray(b.delta[name])
            if not np.allclose(np.asarray(a.delta[name]), want, rtol=1e-3, atol=1e-5):
                return False
    return True


def _stack(parts: list[Any], device: Any) -> tuple[Any, Any, Any]:
    """Inputs and labels of many clients, padded to the longest: (C, n_max, ...)."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    counts = torch.tensor([int(y.shape[0]) for _, y in parts], dtype=torch.long)
    if int(counts.max()) == 0:  # nothing at all: one zero row each keeps shapes valid
        x0, y0 = parts[0]
        shape = (len(parts), 1, *x0.shape[1:])
        xs, ys = torch.zeros(shape, dtype=x0.dtype), torch.zeros(shape[:2], dtype=y0.dtype)
    elif bool((counts == counts[0]).all()):
        xs, ys = torch.stack([x for x, _ in parts]), torch.stack([y for _, y in parts])
    else:
        xs = pad_sequence([x for x, _ in parts], batch_first=True)
        ys = pad_sequence([y for _, y in parts], batch_first=True)
    return xs.to(device), ys.to(device), counts.to(device)


def _rows(stacked: Any, index: Any) -> Any:
    """``stacked[c, index[c, j]]`` for every client c: one contiguous gather."""
    import torch

    count, n = stacked.shape[0], stacked.shape[1]
    offsets = (torch.arange(count, device=index.device) * n).view(count, *[1] * (index.dim() - 1))
    flat = stacked.reshape(count * n, *stacked.shape[2:])
    return flat.index_select(0, (index + offsets).reshape(-1)).view(*index.shape, *flat.shape[1:])


def _schedule(
    counts: Any, batch: int, epochs: int, seed: int, shuffle: bool, device: Any
) -> tuple[Any, Any]:
    """Each client's batches in the order its own ``train`` would take them: shuffled by
    ``randperm`` from ``seed`` each epoch, or in order (``shuffle`` false).

    ``index[c, t]`` holds the positions of client c's t-th batch (padded with 0),
    ``mask[c, t]`` which of them are real; a client out of batches has an all-zero row.
    Every client of a round draws its order from the same seed, so clients with the same
    number of samples share one schedule: it is built once per distinct size.
    """
    import torch

    sizes = counts.cpu()
    total = epochs * math.ceil(int(sizes.max()) / batch) if len(sizes) else 0
    index = torch.zeros((len(sizes), total, batch), dtype=torch.long)
    mask = torch.zeros((len(sizes), total, batch), dtype=torch.float32)
    for n in torch.unique(sizes).tolist():
        steps = epochs * math.ceil(n / batch)
        one_index = torch.zeros((steps, batch), dtype=torch.long)
        one_mask = torch.zeros((steps, batch), dtype=torch.float32)
        gen = torch.Generator().manual_seed(seed)
        t = 0
        for _ in range(epochs):
            order = torch.randperm(n, generator=gen) if shuffle else torch.arange(n)
            for start in range(0, n, batch):
                piece = order[start : start + batch]
                one_index[t, : len(piece)] = piece
                one_mask[t, : len(piece)] = 1.0
                t += 1
        members = (sizes == n).nonzero().squeeze(1)
        index[members, :steps] = one_index
        mask[members, :steps] = one_mask
    return index.to(device), mask.to(device)


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def make_trainer(
    task: Any, shards: ShardCache, device: str = "cpu", batched: bool | None = None
) -> ClientTrainer:
    """``batched`` None: a batchable task's trainer chooses by its probe among every way,
    the loop included; True: the batched ways only; False (or a task that is not
    batchable): the task's own loop. The process that trains keeps the memory it frees
    (:mod:`flotilla.simulation.allocator`): rounds reuse it."""
    keep_freed_memory()
    if batched is False or (batched is None and not is_batchable(task)):
        return LoopTrainer(task, shards)
    paths = PATHS if batched is None else ("stacked", "vmap")
    return BatchedTrainer(task, shards, device, paths=paths)
