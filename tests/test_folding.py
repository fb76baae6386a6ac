"""Folding where clients train (``flotilla.simulation.folding``): a slice's partial sum
does not depend on how it is chunked, and a refused update is named, not summed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flotilla.core.errors import FlotillaError
from flotilla.core.tensors import ModelState, state_spec
from flotilla.simulation.folding import FoldRequest, SliceFolder, merge_slices
from flotilla.simulation.training import ClientTrainer, ShardCache, make_trainer
from flotilla.tasks import load_task, model_state

TASK = "flotilla.tasks.digits:DigitsTask"
CONFIG = json.dumps(
    {"train": {"batch_size": 16}, "data": {"params": {"augment": True}}, "compression": {}}
)


Setup = tuple[ClientTrainer, ModelState]


@pytest.fixture(scope="module")
def setup() -> Setup:
    task = load_task(TASK)
    trainer = make_trainer(task, ShardCache(task, 60), "cpu", None)
    return trainer, model_state(task.build_model(0))


def _request(model: ModelState, strategy: str = "fedavg") -> FoldRequest:
    return FoldRequest("job", 1, CONFIG, state_spec(model), 9, strategy, "{}")


def test_a_slice_folds_the_same_in_chunks_as_at_once(setup: Setup) -> None:
    trainer, model = setup
    clients = list(range(0, 60, 3))
    whole = SliceFolder(trainer).fold(model, clients, 5, _request(model))
    delta_bytes = sum(a.nbytes for a in model.values())
    chunked = SliceFolder(trainer, deltas_in_flight_bytes=3 * delta_bytes)
    parts = chunked.fold(model, clients, 5, _request(model))
    assert [c.index for c in parts.clients] == clients == [c.index for c in whole.clients]
    assert whole.partial is not None and parts.partial is not None
    assert parts.partial.count == whole.partial.count == len(clients)
    assert parts.partial.weight == whole.partial.weight == sum(c.num_samples for c in whole.clients)
    for name, total in whole.partial.total.items():
        np.testing.assert_allclose(parts.partial.total[name], total, rtol=1e-5, atol=1e-6)
    # Two workers' slices merged are the whole slice too.
    halves = [
        SliceFolder(trainer).fold(model, h, 5, _request(model)) for h in (clients[:7], clients[7:])
    ]
    merged = merge_slices(halves)
    assert merged.partial is not None and merged.partial.count == len(clients)
    assert [c.index for c in merged.clients] == clients
    for name, total in whole.partial.total.items():
        np.testing.assert_allclose(merged.partial.total[name], total, rtol=1e-5, atol=1e-6)


def test_a_strategy_that_needs_every_update_is_not_folded(setup: Setup) -> None:
    trainer, model = setup
    with pytest.raises(FlotillaError, match="cannot be folded"):
        SliceFolder(trainer).fold(model, [0, 1], 5, _request(model, "median"))
