"""Secure rounds (SecAgg+) end to end: real agents on the digits job, in one process.

The must-show of issue 16: with 10 agents the committed model is exactly what plain FedAvg
commits on the same quantized updates; 3 of 10 dropping after their masked input still
unmask; fewer than t left in a neighbourhood fails the round cleanly and the job retries
it. Each agent's SecAgg+ party is made by a recording factory that replays its randomness
from a seed, so the test can recompute every survivor's quantized update itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from flotilla.aggregation import make_aggregator, parse_params
from flotilla.core.blobstore import BlobStore
from flotilla.core.events import RoundRetried
from flotilla.core.flat import unflatten
from flotilla.core.tensors import decode_state, state_spec
from flotilla.secagg import (
    SecAggConfig,
    SecAggDevice,
    SecAggRefused,
    Session,
    Stage,
    dequantize_sum,
    quantize,
)
from flotilla.secagg.quantize import weighted
from tests.support.databases import database_url, deployment_database
from tests.support.inproc import in_process_federation

pytestmark = pytest.mark.timeout(240)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "digits.toml"
SECURE = (
    "job.rounds=1", "job.clients_per_round=10", "job.min_quorum=5", "job.round_deadline_s=90",
    "privacy.secure_aggregation=true", "privacy.stage_timeout_s=15",
)  # fmt: skip


def replayable(seed: bytes) -> Callable[[int], bytes]:
    """A deterministic randomness source (ChaCha20 keystream): the same seed, the same bytes."""
    key = hashlib.sha256(seed).digest()
    stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
    return lambda n: stream.update(bytes(n))


class DropsAfter(SecAggDevice):
    """A party that answers up to ``last`` and then stops (the agent reports it gone)."""

    last: Stage = Stage.MASKED_INPUT

    def respond(self, stage: Stage, message: bytes) -> bytes:
        if stage > self.last:
            raise SecAggRefused("out of stage", "test: this device drops out here")
        return super().respond(stage, message)


@dataclass
class Parties:
    """Makes every agent's SecAgg+ party and remembers what it masked, by (round, device)."""

    #: Agent index -> stages it answers in its first secure round (then it drops out).
    drops: Mapping[int, Stage] = field(default_factory=dict)
    inputs: dict[tuple[int, str], tuple[np.ndarray, int, bytes]] = field(default_factory=dict)
    configs: dict[int, SecAggConfig] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)
    attempts: dict[str, int] = field(default_factory=dict)

    def options(self, index: int) -> dict[str, Any]:
        def make(
            config: SecAggConfig,
            session: Session,
            device_id: str,
            identity: Ed25519PrivateKey,
            update: np.ndarray,
            weight: int,
        ) -> SecAggDevice:
            attempt = self.attempts[device_id] = self.attempts.get(device_id, 0) + 1
            seed = f"{session.job_id}/{session.round}/{device_id}/{attempt}".encode()
            self.inputs[(session.round, device_id)] = (update.copy(), weight, seed)
            self.configs[session.round] = config
            args = (config, session, device_id, identity, update, weight, replayable(seed))
            last = self.drops.get(index)
            if last is not None and attempt == 1:
                self.dropped.add(device_id)
                party = DropsAfter(*args)
                party.last = last
                return party
            return SecAggDevice(*args)

        return {"secagg_device": make}

    def reference(self, round_no: int, survivors: list[str]) -> tuple[np.ndarray, int]:
        """The weighted sum of the survivors' quantized updates, from their inputs and
        replayed randomness alone, and its total weight."""
        config = self.configs[round_no]
        total = None
        weight_sum = 0
        for device_id in survivors:
            update, weight, seed = self.inputs[(round_no, device_id)]
            q = weighted(quantize(update, config, replayable(seed)), weight, config)
            total = q if total is None else total + q
            weight_sum += int(q[-1])
        assert total is not None
        total &= np.uint64((1 << config.modulus_bits) - 1)
        return total, weight_sum


async def _run(tmp_path: Path, parties: Parties, *sets: str) -> tuple[Any, Any, list[str]]:
    url = database_url(deployment_database(), tmp_path)
    retried: list[str] = []

    class Retries:
        def emit(self, event: object) -> None:
            if isinstance(event, RoundRetried):
                retried.append(event.reason)

    async with in_process_federation(tmp_path / "state", url, sinks=[Retries()]) as fed:
        job_id = await fed.submit(EXAMPLE, *SECURE, *sets)
        job = await fed.store.get_job(job_id)
        assert job is not None
        start_sha = job.checkpoint_sha256
        await fed.start_agents(10, options=parties.options)
        await fed.wait_for(job_id, timeout=200)
        detail = await fed.federation.get_job(job_id, with_rounds=True)
    blobs = BlobStore(tmp_path / "state" / "blobs")
    return (blobs, start_sha), detail, retried


def _check_exact(
    blobs: BlobStore, start_sha: str, record: Any, parties: Parties, strategy: str = "fedavg"
) -> None:
    """The committed model is plain FedAvg's on the survivors' quantized updates, bit for bit."""
    survivors = sorted(p.device_id for p in record.participants)
    values, total_weight = parties.reference(record.round, survivors)
    config = parties.configs[record.round]
    start = decode_state(blobs.get(start_sha))
    layout = state_spec(start)
    mean = unflatten(dequantize_sum(values[:-1], total_weight, config), layout)
    aggregator = make_aggregator(strategy, parse_params(strategy, {}), layout, None)
    aggregator.begin(record.round, {k: v.copy() for k, v in start.items()})
    aggregator.add(mean, float(total_weight))
    expected = aggregator.finalize()
    committed = decode_state(blobs.get(record.checkpoint_sha256))
    assert committed.keys() == expected.keys()
    for name in expected:
        assert np.array_equal(committed[name], expected[name]), name


async def test_ten_agents_commit_exactly_fedavg_of_their_quantized_updates(
    tmp_path: Path,
) -> None:
    parties = Parties()
    (blobs, start_sha), detail, retried = await _run(tmp_path, parties)
    assert detail.job.state == "completed", retried
    [record] = detail.rounds
    assert len(record.participants) == 10
    assert record.metrics["secagg_survivors"] == 10
    _check_exact(blobs, start_sha, record, parties)
    assert record.account.failures == ()


async def test_three_of_ten_drop_after_their_masked_input_and_the_round_unmasks(
    tmp_path: Path,
) -> None:
    parties = Parties(drops={1: Stage.MASKED_INPUT, 4: Stage.MASKED_INPUT, 7: Stage.MASKED_INPUT})
    (blobs, start_sha), detail, retried = await _run(tmp_path, parties)
    assert detail.job.state == "completed", retried
    [record] = detail.rounds
    assert retried == []
    # Their masked inputs arrived, so they are in the sum (SecAgg+'s U3): the server
    # rebuilt their self-masks from their neighbours' shares. The round's record names them
    # as participants and as failures (they never finished), with the stage they left in.
    assert len(record.participants) == 10 and len(parties.dropped) == 3
    assert {f.device_id for f in record.account.failures} == parties.dropped
    left = [d for d in record.account.decisions if "dropped out" in d]
    assert len(left) == 3 and all("CONSISTENCY" in d for d in left), left
    _check_exact(blobs, start_sha, record, parties)


async def test_below_threshold_the_round_fails_cleanly_and_the_retry_commits(
    tmp_path: Path,
) -> None:
    """k = 8, t = 5 for 10 devices: five dropping after their masked input leave some
    neighbourhood with four. Nothing is committed; the retry (all back) commits."""
    parties = Parties(drops={i: Stage.MASKED_INPUT for i in range(5)})
    (blobs, start_sha), detail, retried = await _run(tmp_path, parties)
    assert detail.job.state == "completed"
    assert "secagg" in retried
    [record] = detail.rounds
    assert len(record.participants) == 10
    _check_exact(blobs, start_sha, record, parties)


async def test_dp_fedavg_runs_over_secure_rounds_and_spends_its_budget(tmp_path: Path) -> None:
    """Devices clip to the DP clip norm and weigh 1; the server noises the unmasked sum."""
    parties = Parties()
    sets = ("aggregation.strategy=dp_fedavg", "aggregation.params.noise_multiplier=0.3",
            "aggregation.params.clip_norm=0.5", "aggregation.params.epsilon=100")  # fmt: skip
    _, detail, retried = await _run(tmp_path, parties, *sets)
    assert detail.job.state == "completed", retried
    [record] = detail.rounds
    assert record.metrics["epsilon"] > 0
    assert record.metrics["secagg_total_weight"] == 10  # every update weighs 1
    for update, weight, _ in parties.inputs.values():
        assert weight == 1 and np.linalg.norm(update) <= 0.5 + 1e-5
