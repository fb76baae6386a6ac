"""A synchronous federated loop in one process, built from the platform's own parts.

Clients are real :class:`LocalTrainer` s (local training, update momentum, uplink codec,
error feedback); their payloads go through the server's ``decode_update`` and the job's
aggregator from the engine's :class:`JobPlan`; each round's model is scored by the
server's evaluator. Only the transport is left out, so tests can afford the dozens of
rounds that byte-to-accuracy comparisons need.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from flotilla.client.training import LocalTrainer, TrainWork
from flotilla.core.round_config import RoundConfig
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import decode_state, encode_state, state_spec
from flotilla.engine import JobPlan
from flotilla.server.federation.uploads import decode_update
from flotilla.tasks import Shard, ShardTraining
from flotilla.tasks.runtime import LocalTasks

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits.toml"


@dataclass
class LoopResult:
    accuracy: list[float] = field(default_factory=list)
    #: Cumulative uplink bytes after each round.
    uplink_bytes: list[int] = field(default_factory=list)

    def bytes_to(self, target: float) -> int | None:
        """Uplink bytes spent when held-out accuracy first reached ``target``."""
        for acc, spent in zip(self.accuracy, self.uplink_bytes, strict=True):
            if acc >= target:
                return spent
        return None


def run_federation(
    spec: JobSpec,
    clients: int,
    per_round: int,
    rounds: int,
    state_dir: Path | None = None,
    stop_at: float | None = None,
    seed: int = 0,
) -> LoopResult:
    plan = JobPlan.from_spec(spec)
    model = decode_state(LocalTasks().initial_model(spec))
    model = {k: v.copy() for k, v in model.items()}
    layout = state_spec(model)
    aggregator = plan.aggregator(layout, state_dir / "spool" if state_dir else None)
    evaluate = LocalTasks().evaluator(spec)
    assert evaluate is not None
    trainers = [
        LocalTrainer(ShardTraining(spec.job.task, Shard(i, clients)), state_dir=_dir(state_dir, i))
        for i in range(clients)
    ]
    rng = random.Random(seed)
    result = LoopResult()
    spent = 0
    try:
        for round_no in range(1, rounds + 1):
            config = plan.client_config_json(layout, aggregator.client_config())
            order = TrainWork(
                "loop",
                (spec.job.seed * 1_000_003 + round_no) % 2**63,
                RoundConfig.from_json(config),
            )
            if plan.traits.needs_sampling_rate:
                aggregator.check_budget(per_round / clients)  # type: ignore[attr-defined]
            aggregator.begin(round_no, model)
            broadcast = encode_state(model)
            for i in rng.sample(range(clients), per_round):
                outcome = trainers[i].train(broadcast, order)
                spent += len(outcome.payload)
                delta = decode_update(memoryview(outcome.payload), layout, plan.uplink, 1 << 26)
                aggregator.add(delta, float(outcome.num_samples))
            model = aggregator.finalize()
            if plan.traits.needs_sampling_rate:
                aggregator.spend(per_round / clients)  # type: ignore[attr-defined]
            result.accuracy.append(evaluate(model)["accuracy"])
            result.uplink_bytes.append(spent)
            if stop_at is not None and result.accuracy[-1] >= stop_at:
                break
    finally:
        aggregator.close()
    return result


def _dir(root: Path | None, index: int) -> Path | None:
    return None if root is None else root / f"client-{index}"
