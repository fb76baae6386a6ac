"""What a secure job may combine with, checked at submission; DP-FedAvg over a secure sum;
the task config a secure round's devices read; the stage exchange's refusals."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest

from flotilla.aggregation import DPFedAvg, DPParams, SecurelySummed
from flotilla.core.errors import ConfigError, StaleRoundError, WireError
from flotilla.core.flat import flatten, secure_input, unflatten
from flotilla.core.jobfile import load_job_specs
from flotilla.core.round_config import RoundConfig, SecurePlan
from flotilla.core.spec import PrivacySection
from flotilla.core.tensors import TensorSpec
from flotilla.engine import StageExchange, validate_spec
from flotilla.secagg import SecAggConfig, Session, Stage

pytestmark = pytest.mark.timeout(60)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "digits.toml"
SECURE = ("privacy.secure_aggregation=true", "job.clients_per_round=10")


def _spec(*sets: str) -> object:
    [spec] = load_job_specs(EXAMPLE, (*SECURE, *sets))
    return spec


@pytest.mark.parametrize(
    ("sets", "names"),
    [
        (("aggregation.strategy=median",), "aggregation.strategy 'median' needs the individual"),
        (("aggregation.strategy=trimmed_mean",), "needs the individual updates"),
        (("aggregation.strategy=krum",), "needs the individual updates"),
        (("aggregation.strategy=multikrum",), "needs the individual updates"),
        (("aggregation.strategy=centered_clipping",), "needs the individual updates"),
        (("aggregation.strategy=fedbuff",), "'fedbuff' is asynchronous"),
        (("aggregation.transport=p2p",), 'aggregation.transport must be "server"'),
        (("compression.uplink=int8",), 'compression.uplink must be "none"'),
        (
            (
                "aggregation.strategy=dp_fedavg",
                "aggregation.params.adaptive_clip=true",
                "aggregation.params.clip_count_stddev=1.0",
            ),
            "adaptive_clip must be false",
        ),
        (("privacy.modulus_bits=20",), "overflow modulus_bits=20"),
        (("privacy.neighbours=3",), "neighbours must be even"),
    ],
    ids=lambda v: v[0] if isinstance(v, tuple) else None,
)
def test_a_secure_job_is_refused_at_submission_with_what_cannot_combine(
    sets: tuple[str, ...], names: str
) -> None:
    with pytest.raises(ConfigError, match="privacy") as info:
        validate_spec(_spec(*sets))  # type: ignore[arg-type]
    assert names in str(info.value)


@pytest.mark.parametrize(
    "strategy", ["fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "dp_fedavg"]
)
def test_weighted_sum_strategies_are_allowed(strategy: str) -> None:
    validate_spec(_spec(f"aggregation.strategy={strategy}"))  # type: ignore[arg-type]


LAYOUT = (TensorSpec("b", "float32", (3,)), TensorSpec("a", "float32", (2, 2)))


def test_dp_fedavg_adds_its_noise_to_the_secure_sum_as_to_the_updates_one_by_one() -> None:
    """Devices clip to the DP clip norm (``secure_input``); the server folds their sum and
    calibrates the noise to the number of updates in it, not to one update."""
    rng = np.random.default_rng(0)
    updates = [
        {s.name: rng.normal(size=s.shape).astype(np.float32) for s in LAYOUT} for _ in range(6)
    ]
    params = DPParams(noise_multiplier=0.5, clip_norm=1.0)
    clipped = [unflatten(secure_input(u, 7, "one", 1.0)[0], LAYOUT) for u in updates]
    assert all(secure_input(u, 7, "one", 1.0)[1] == 1 for u in updates)
    for c in clipped:
        assert np.linalg.norm(flatten(c)) <= 1.0 + 1e-6
    start = {s.name: np.zeros(s.shape, np.float32) for s in LAYOUT}

    def run(fold: object) -> dict[str, np.ndarray]:
        agg = DPFedAvg(LAYOUT, params, rng=np.random.default_rng(42))
        agg.check_budget(0.1)
        agg.begin(1, {k: v.copy() for k, v in start.items()})
        fold(agg)  # type: ignore[operator]
        return agg.finalize()

    def one_by_one(agg: DPFedAvg) -> None:
        for c in clipped:
            agg.add(c, 1.0)

    def summed(agg: DPFedAvg) -> None:
        assert isinstance(agg, SecurelySummed)
        total = {n: sum(c[n] for c in clipped) for n in clipped[0]}
        agg.add_sum(total, len(clipped))

    a, b = run(one_by_one), run(summed)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6)


def test_devices_read_the_secure_plan_from_their_task_config() -> None:
    plan = SecurePlan(PrivacySection(secure_aggregation=True), ("d1", "d2", "d3"), "one", 0.5)
    raw = {"train": {}, "data": {}, "compression": {}, "secagg": plan.to_dict()}
    config = RoundConfig.from_json(json.dumps(raw))
    assert config.secagg == plan
    with pytest.raises(WireError, match="secagg"):
        RoundConfig.from_json('{"secagg": {"participants": ["a", "a"]}}')


class NoKeys:
    async def device_keys(self, device_ids: Sequence[str]) -> Mapping[str, bytes]:
        return {}


async def test_the_exchange_refuses_strangers_wrong_stages_duplicates_and_oversize() -> None:
    section = PrivacySection(secure_aggregation=True)
    session = Session("job", 1, ("d1", "d2", "d3"))
    exchange = StageExchange(
        SecAggConfig.from_privacy(section, 3), session, NoKeys(), 10, lambda: 5.0
    )
    with pytest.raises(StaleRoundError, match="not a participant"):
        await exchange.exchange("d9", Stage.ADVERTISE, b"")
    with pytest.raises(WireError, match="at stage ADVERTISE"):
        await exchange.exchange("d1", Stage.SHARE, b"")
    with pytest.raises(WireError, match="at most"):
        await exchange.exchange("d1", Stage.ADVERTISE, bytes(10**6))
    waiting = asyncio.ensure_future(exchange.exchange("d1", Stage.ADVERTISE, b"x"))
    await asyncio.sleep(0)
    with pytest.raises(WireError, match="already answered"):
        await exchange.exchange("d1", Stage.ADVERTISE, b"x")
    exchange.drop("d2")
    exchange.abort("test over")
    with pytest.raises(StaleRoundError, match="went on without"):
        await waiting
    with pytest.raises(StaleRoundError, match="aborted"):
        await exchange.exchange("d3", Stage.ADVERTISE, b"x")


def test_the_http_edge_reads_a_secure_message_path_and_headers_strictly() -> None:
    from flotilla.server.http import device_wire as wire

    headers = {wire.ROUND_TOKEN_HEADER: "tok"}
    ref, stage = wire.secagg_path({"job_id": "job-1", "round": "3", "stage": "2"}, headers)
    assert (ref.job_id, ref.round, ref.round_token, stage) == ("job-1", 3, "tok", 2)
    for path, hdrs, why in (
        ({"job_id": "j", "round": "3", "stage": "2"}, {}, "round token"),
        ({"job_id": "j", "round": "-1", "stage": "2"}, headers, "round in the path"),
        ({"job_id": "j", "round": "1", "stage": "x"}, headers, "stage in the path"),
        ({"job_id": "j", "round": "1", "stage": "9" * 12}, headers, "stage in the path"),
    ):
        with pytest.raises(WireError, match="(?i)" + why.split()[0]):
            wire.secagg_path(path, hdrs)
