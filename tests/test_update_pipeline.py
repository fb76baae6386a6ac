"""One update pipeline: a simulated device uploads exactly the bytes a real agent would.

The agent's path (:class:`LocalTrainer`'s pipeline, state in files in its state dir) and a
simulated device's (:class:`SimulatedUplink`, state in memory-mapped rows) get the same
deltas, codec, error feedback, update momentum and codec entropy, over several rounds and
an agent restart; their payloads must be identical, byte for byte.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from flotilla.client.training import LocalTrainer
from flotilla.compression import CODEC_NAMES, CodecContext, decode_state_with
from flotilla.core.round_config import RoundConfig
from flotilla.core.spec import CompressionSection, DataSection, TrainSection
from flotilla.core.tensors import ModelState, TensorSpec, decode_state, encode_state
from flotilla.simulation.uplink import SimulatedUplink
from flotilla.tasks import Shard, ShardTraining
from tests.support.lifetime import bound

LAYOUT = (
    TensorSpec("fc.weight", "F32", (64, 32)),
    TensorSpec("fc.bias", "F32", (32,)),
    TensorSpec("conv.weight", "F32", (4, 3, 5)),
)
ROUNDS = 5
#: The agent's trainer here only encodes (its training is never called).
UNTRAINED = ShardTraining("unused:Task", Shard(0, 1))
#: The round before which the agent process restarts (a new trainer on the same state dir).
RESTART_AT = 3
SEED = 1234
CLIENTS = 4
CLIENT = 2


def _deltas(rounds: int) -> list[ModelState]:
    rng = np.random.default_rng(7)
    return [
        {s.name: rng.normal(0.0, 0.01, s.shape).astype(np.float32) for s in LAYOUT}
        for _ in range(rounds)
    ]


def _config(codec: str, error_feedback: bool, momentum: float) -> RoundConfig:
    return RoundConfig(
        TrainSection(update_momentum=momentum),
        DataSection(),
        CompressionSection(uplink=codec, error_feedback=error_feedback),
        LAYOUT,
    )


def _sim_entropy(seed: int) -> Callable[[], CodecContext]:
    """The codec contexts a simulated job's uplink gives CLIENT, one per round from 1."""
    rounds = itertools.count(1)
    return lambda: SimulatedUplink.context(seed, next(rounds), CLIENT)


def _simulated_payloads(config: RoundConfig, deltas: list[ModelState], tmp: Path) -> list[bytes]:
    """Each round's payload as the simulator makes it, through ``SimulatedUplink.__call__``."""
    uplink = SimulatedUplink(config, LAYOUT, SEED, tmp / "sim", CLIENTS)
    pipeline = uplink.pipeline
    encode = pipeline.encode
    sent: list[bytes] = []

    def spy(client: int, delta: ModelState, context: CodecContext | None = None) -> bytes:
        payload = encode(client, delta, context)
        sent.append(payload)
        return payload

    pipeline.encode = spy  # type: ignore[method-assign]
    out = []
    for rnd, delta in enumerate(deltas, start=1):
        decoded, size = uplink(CLIENT, delta, rnd)
        if pipeline.plain:  # the fast path hands the delta on without encoding it
            assert not sent
            payload = encode_state(decoded)
        else:
            payload = sent.pop()
            server = decode_state_with(payload, LAYOUT, len(payload), codec=pipeline.codec)
            for name, value in server.items():
                np.testing.assert_array_equal(decoded[name], value)
        assert size == len(payload)
        out.append(payload)
    return out


def _agent_payloads(config: RoundConfig, deltas: list[ModelState], tmp: Path) -> list[bytes]:
    """Each round's payload as an agent makes it, restarting the agent once midway."""
    entropy = _sim_entropy(SEED)
    out = []
    trainer = None
    for rnd, delta in enumerate(deltas, start=1):
        if trainer is None or rnd == RESTART_AT:
            trainer = LocalTrainer(UNTRAINED, state_dir=tmp / "agent", entropy=entropy)
        pipeline = trainer.pipeline(config)
        out.append(pipeline.encode("job-1", pipeline.smooth("job-1", delta)))
    return out


@pytest.mark.parametrize("momentum", [0.0, 0.5], ids=["no-momentum", "momentum"])
@pytest.mark.parametrize("error_feedback", [False, True], ids=["no-ef", "ef"])
@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_agent_and_simulated_device_upload_identical_bytes(
    codec: str, error_feedback: bool, momentum: float, tmp_path: Path
) -> None:
    config = _config(codec, error_feedback, momentum)
    deltas = _deltas(ROUNDS)
    agent = _agent_payloads(config, deltas, tmp_path)
    simulated = _simulated_payloads(config, deltas, tmp_path)
    for rnd, (mine, theirs) in enumerate(zip(agent, simulated, strict=True), start=1):
        assert mine == theirs, f"round {rnd}: the payloads differ"
    if momentum > 0:  # the smoothing took effect: round 2 is not the raw delta any more
        first = (
            decode_state(agent[1])
            if codec == "none"
            else decode_state_with(agent[1], LAYOUT, len(agent[1]))
        )
        assert not np.allclose(first["fc.bias"], deltas[1]["fc.bias"], atol=1e-6)


def test_state_carries_over_rounds_so_the_check_is_not_vacuous(tmp_path: Path) -> None:
    """With error feedback and momentum, round 2's bytes depend on round 1: an agent that
    forgot its state would not match the simulator."""
    config = _config("topk", True, 0.5)
    deltas = _deltas(2)
    simulated = _simulated_payloads(config, deltas, tmp_path)
    entropy = _sim_entropy(SEED)
    forgetful = []
    for i, delta in enumerate(deltas):  # a fresh trainer and state dir every round
        trainer = LocalTrainer(UNTRAINED, state_dir=tmp_path / f"a{i}", entropy=entropy)
        pipeline = trainer.pipeline(config)
        forgetful.append(pipeline.encode("job-1", pipeline.smooth("job-1", delta)))
    assert forgetful[0] == simulated[0]
    assert forgetful[1] != simulated[1]


def test_the_simulator_gets_the_pipeline_without_the_agent() -> None:
    """Simulated devices share the pipeline through compression, not through the client."""
    code = (
        "import sys, flotilla.simulation; "
        "print(sorted(m for m in sys.modules if m.startswith('flotilla.client') or m == 'grpc'))"
    )
    out = subprocess.run(
        bound([sys.executable, "-c", code]),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == "[]"
