"""``rl``: greedy+ plus a learned residual policy, trained online by REINFORCE.

A policy that learns device sets from scratch must beat a near-oracle heuristic with a few
dozen noisy rewards, and pays for every exploring round; so this one starts as greedy+.
Each candidate's score is ``lead`` if greedy+ picked it (0 if not) plus what a small MLP
makes of its features (:mod:`flotilla.scheduling.features`, the job's state and that
same mark); the MLP's output layer starts at zero, so the untrained policy is greedy+ with
rare swaps (Plackett-Luce draws, sampled with the Gumbel top-k trick: at ``lead = 8`` about
one device in two rounds is swapped on a 400-device fleet). The residual learns where
greedy+'s predicted cost misleads it.

When the round closes, its observed cost (greedy+'s: the slowest delivered device scaled by
the data ratio, failures charged as deadline-long waits, plus the fairness it added) over
the job's typical round time is the negative reward; its advantage over the **job's own**
running baseline times the gradient of the drawn set's log-probability trains the MLP.
Weights are the selector's state, committed with every round; baselines are per job and
never restored (a baseline from another job or fleet says nothing of this one). A policy
file written by a simulation (``policy_file``) starts the weights.

Torch is imported when the selector is built, never by the scheduling package itself.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flotilla.core.device import DeviceProfile
from flotilla.core.errors import SpecError
from flotilla.scheduling.cost import CostModel, observed_cost
from flotilla.scheduling.data_greedy import DataGreedyParams, DataGreedySelector, data_ratio
from flotilla.scheduling.duration import DurationModel
from flotilla.scheduling.features import DEVICE_FEATURES, device_features, job_features
from flotilla.scheduling.history import RoundOutcome

INPUTS = len(DEVICE_FEATURES) + 3  # + job_features + greedy+'s mark
#: Weight of the newest round in a job's running reward baseline and typical round time.
_RUNNING = 0.1


@dataclass(frozen=True, slots=True)
class RLParams:
    """``rl``: REINFORCE over a device-scoring MLP."""

    hidden: int = 32
    learning_rate: float = 0.05
    #: The residual's scores are divided by this before sampling: higher explores more.
    temperature: float = 1.0
    #: Score added to the devices greedy+ picked: how firmly the policy starts as greedy+.
    lead: float = 8.0
    #: Weights to start from (a JSON file a simulation wrote under ``DIR/selectors/``).
    policy_file: str = ""
    #: Seeds the initial weights.
    seed: int = 0


@dataclass(slots=True)
class _Drawn:
    job_id: str
    features: np.ndarray
    lead: np.ndarray  # per candidate: greedy+'s mark times the lead
    order: np.ndarray  # indices into features, in draw order
    candidate_ids: list[str]
    data_ratio: float


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
        hidden, out = torch.nn.Linear(INPUTS, params.hidden), torch.nn.Linear(params.hidden, 1)
        self._net = torch.nn.Sequential(hidden, torch.nn.Tanh(), out)
        with torch.no_grad():
            for p in hidden.parameters():
                p.uniform_(-0.3, 0.3, generator=gen)
            for p in out.parameters():
                p.zero_()  # the residual starts at nothing: greedy+
        self._opt = torch.optim.Adam(self._net.parameters(), lr=params.learning_rate)
        self._greedy_plus = DataGreedySelector(model, cost, DataGreedyParams())
        #: Per job: running reward baseline and typical round time (never restored).
        self._baseline: dict[str, float] = {}
        self._typical_s: dict[str, float] = {}
        self.updates = 0
        self._drawn: _Drawn | None = None
        if params.policy_file:
            self.restore(_read_policy(params.policy_file))

    def _inputs(
        self, job_id: str, candidates: Sequence[DeviceProfile], count: int, marked: np.ndarray
    ) -> np.ndarray:
        dev = device_features(self._model, job_id, candidates, self._deadline_s)
        rounds = self._model.history.rounds.get(job_id, 0)
        job = job_features(len(candidates), count, rounds, self._rounds_total)
        return np.concatenate(
            [dev, np.broadcast_to(job, (len(candidates), len(job))), marked[:, None]], axis=1
        )

    def _scores(self, features: np.ndarray) -> Any:
        x = self._torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
        return self._net(x).squeeze(1) / self._p.temperature

    def select(self, job_id: str, candidates: Sequence[DeviceProfile], count: int) -> list[str]:
        n = len(candidates)
        if n == 0 or count <= 0:
            return []
        knobs = DataGreedyParams()
        inputs = self._greedy_plus.inputs(job_id, candidates, (knobs.loss_weight,))
        choice = self._greedy_plus.choose(job_id, candidates, count, knobs, inputs)
        marked = np.zeros(n, dtype=np.float32)
        marked[choice.picks] = 1.0
        features = self._inputs(job_id, candidates, count, marked)
        lead = self._p.lead * marked.astype(np.float64)
        with self._torch.no_grad():
            scores = lead + self._scores(features).numpy().astype(np.float64)
        gen = np.random.default_rng(self._rng.getrandbits(64))
        gumbel = -np.log(-np.log(gen.uniform(1e-12, 1.0, size=n)))
        order = np.argsort(-(scores + gumbel), kind="stable")[: min(count, n)]
        ids = [c.device_id for c in candidates]
        drawn_utility = float(inputs.utility[knobs.loss_weight][order].sum())
        ratio = float(data_ratio(drawn_utility, choice.greedy_utility, knobs.data_rate))
        self._drawn = _Drawn(job_id, features, lead, order, ids, ratio)
        return [ids[int(i)] for i in order]

    def observe(self, outcome: RoundOutcome) -> None:
        drawn, self._drawn = self._drawn, None
        if drawn is None or drawn.job_id != outcome.job_id:
            return
        job = outcome.job_id
        times = list(outcome.durations.values())
        slowest = max(times) if times else self._deadline_s
        typical = self._typical_s.get(job, slowest)
        self._typical_s[job] = (1 - _RUNNING) * typical + _RUNNING * slowest
        history = self._model.history
        cost = observed_cost(
            self._cost, outcome, self._deadline_s, history, drawn.candidate_ids, drawn.data_ratio
        )
        reward = -cost / max(typical, 1e-6)
        baseline = self._baseline.get(job, reward)
        self._baseline[job] = (1 - _RUNNING) * baseline + _RUNNING * reward
        advantage = reward - baseline
        if advantage == 0.0:
            return
        torch = self._torch
        scores = torch.from_numpy(drawn.lead).float() + self._scores(drawn.features)
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

    def state(self) -> dict[str, Any]:
        return {
            "weights": {k: v.tolist() for k, v in self._net.state_dict().items()},
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
        self.updates = int(state.get("updates", 0))


def _read_policy(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecError(f"scheduling.params.policy_file {path!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise SpecError(f"scheduling.params.policy_file {path!r}: not a policy")
    return data
