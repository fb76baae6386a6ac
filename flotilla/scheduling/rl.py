"""``rl``: a policy network that scores devices, trained online by REINFORCE on round costs.

The policy sees each candidate's features (:mod:`flotilla.scheduling.features`) and the
job's state, scores every candidate with one small MLP, and draws the round's devices
without replacement in proportion to ``exp(score)`` (Plackett-Luce, sampled with the
Gumbel top-k trick). When the round closes, its observed cost ``alpha * T + beta * F``
(T the slowest delivered device, failures charged as deadline-long waits) is the negative
reward; the gradient of the drawn set's log-probability, times the reward's advantage over
a running baseline, trains the network. Weights and baseline are the selector's state:
committed with every round, restored with the job, and loadable from a file written by a
simulation (``policy_file``), so a policy can be pre-trained before it meets real devices.

Torch is imported when the selector is built, never by the scheduling package itself.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flotilla.core.device import DeviceProfile
from flotilla.core.errors import SpecError
from flotilla.scheduling.cost import CostModel, observed_cost
from flotilla.scheduling.duration import DurationModel
from flotilla.scheduling.features import DEVICE_FEATURES, device_features, job_features
from flotilla.scheduling.history import RoundOutcome

INPUTS = len(DEVICE_FEATURES) + 2  # + job_features


@dataclass(frozen=True, slots=True)
class RLParams:
    """``rl``: REINFORCE over a device-scoring MLP."""

    hidden: int = 32
    learning_rate: float = 0.05
    #: Scores are divided by this before sampling: higher explores more.
    temperature: float = 1.0
    #: Running-mean baseline of the reward: ``b = decay * b + (1 - decay) * reward``.
    baseline_decay: float = 0.9
    #: Weights to start from (a JSON file a simulation wrote under ``DIR/selectors/``).
    policy_file: str = ""
    #: Seeds the initial weights.
    seed: int = 0


@dataclass(slots=True)
class _Drawn:
    job_id: str
    features: np.ndarray
    order: np.ndarray  # indices into features, in draw order
    candidate_ids: list[str]


class RLSelector:
    def __init__(
        self,
        model: DurationModel,
        cost: CostModel,
        deadline_s: float,
        rounds_total: int,
        rng: random.Random,
        params: RLParams,
    ) -> None:
        import torch

        self._torch = torch
        self._model = model
        self._cost = cost
        self._deadline_s = deadline_s
        self._rounds_total = rounds_total
        self._rng = rng
        self._p = params
        gen = torch.Generator().manual_seed(params.seed)
        self._net = torch.nn.Sequential(
            torch.nn.Linear(INPUTS, params.hidden),
            torch.nn.Tanh(),
            torch.nn.Linear(params.hidden, 1),
        )
        with torch.no_grad():
            for p in self._net.parameters():
                p.uniform_(-0.3, 0.3, generator=gen)
        self._opt = torch.optim.Adam(self._net.parameters(), lr=params.learning_rate)
        self._baseline: float | None = None
        self.updates = 0
        self._drawn: _Drawn | None = None
        if params.policy_file:
            self.restore(_read_policy(params.policy_file))

    def _inputs(self, job_id: str, candidates: Sequence[DeviceProfile], count: int) -> np.ndarray:
        dev = device_features(self._model, job_id, candidates, self._deadline_s)
        rounds = self._model.history.rounds.get(job_id, 0)
        job = job_features(len(candidates), count, rounds, self._rounds_total)
        return np.concatenate([dev, np.broadcast_to(job, (len(candidates), len(job)))], axis=1)

    def _scores(self, features: np.ndarray) -> Any:
        x = self._torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
        return self._net(x).squeeze(1) / self._p.temperature

    def select(self, job_id: str, candidates: Sequence[DeviceProfile], count: int) -> list[str]:
        n = len(candidates)
        if n == 0 or count <= 0:
            return []
        features = self._inputs(job_id, candidates, count)
        with self._torch.no_grad():
            scores = self._scores(features).numpy().astype(np.float64)
        gen = np.random.default_rng(self._rng.getrandbits(64))
        gumbel = -np.log(-np.log(gen.uniform(1e-12, 1.0, size=n)))
        order = np.argsort(-(scores + gumbel), kind="stable")[: min(count, n)]
        ids = [c.device_id for c in candidates]
        self._drawn = _Drawn(job_id, features, order, ids)
        return [ids[int(i)] for i in order]

    def observe(self, outcome: RoundOutcome) -> None:
        drawn, self._drawn = self._drawn, None
        if drawn is None or drawn.job_id != outcome.job_id:
            return
        reward = -self.round_cost(outcome, drawn.candidate_ids) / max(self._deadline_s, 1e-6)
        if self._baseline is None:
            self._baseline = reward
        advantage = reward - self._baseline
        decay = self._p.baseline_decay
        self._baseline = decay * self._baseline + (1.0 - decay) * reward
        if advantage == 0.0:
            return
        torch = self._torch
        scores = self._scores(drawn.features)
        order = torch.from_numpy(drawn.order.astype(np.int64))
        picked = scores[order]
        # log P(order) under Plackett-Luce: each draw is over the candidates not yet drawn.
        top = scores.max().detach()
        weights = torch.exp(scores - top)
        drawn_before = torch.cumsum(weights[order], 0) - weights[order]
        left = weights.sum() - drawn_before
        log_prob = (picked - top - torch.log(left.clamp(min=1e-30))).sum()
        loss = -advantage * log_prob
        self._opt.zero_grad()
        loss.backward()
        self._opt.step()
        self.updates += 1

    def round_cost(self, outcome: RoundOutcome, candidate_ids: Sequence[str]) -> float:
        history = self._model.history
        return observed_cost(self._cost, outcome, self._deadline_s, history, candidate_ids)

    def state(self) -> dict[str, Any]:
        return {
            "weights": {k: v.tolist() for k, v in self._net.state_dict().items()},
            "baseline": self._baseline,
            "updates": self.updates,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        torch = self._torch
        try:
            weights = {k: torch.tensor(v, dtype=torch.float32) for k, v in state["weights"].items()}
            self._net.load_state_dict(weights)
        except (KeyError, RuntimeError, TypeError, ValueError) as exc:
            raise SpecError(f"rl selector: policy weights do not fit this network: {exc}") from exc
        baseline = state.get("baseline")
        self._baseline = None if baseline is None or not math.isfinite(baseline) else baseline
        self.updates = int(state.get("updates", 0))


def _read_policy(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecError(f"scheduling.params.policy_file {path!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise SpecError(f"scheduling.params.policy_file {path!r}: not a policy")
    return data
