"""SecAgg+ end to end in one process: the sum is exact, dropouts are survived while every
neighbourhood keeps t, and fail cleanly below."""

from __future__ import annotations

import numpy as np
import pytest

from flotilla.core.errors import ConfigError, SpecError
from flotilla.core.spec import PrivacySection
from flotilla.secagg import (
    SecAggAborted,
    SecAggConfig,
    Session,
    Stage,
    auto_neighbours,
    run_in_process,
)
from flotilla.secagg.graph import neighbourhoods, ring
from flotilla.secagg.quantize import dequantize
from tests.support.secagg import make_round

pytestmark = pytest.mark.timeout(60)


def test_the_unmasked_sum_is_the_plain_weighted_sum_of_the_same_quantized_updates() -> None:
    r = make_round(10, length=300)
    result = run_in_process(r.config, r.session, r.devices, r.server)
    expected = r.plain_sum(r.session.participants)
    assert result.survivors == r.session.participants
    np.testing.assert_array_equal(result.values, expected[:-1])
    assert result.total_weight == int(expected[-1]) == sum(r.weights.values())


def test_mean_is_plain_fedavg_of_the_dequantized_updates() -> None:
    r = make_round(10, length=300)
    result = run_in_process(r.config, r.session, r.devices, r.server)
    plain = sum(
        r.weights[d] * dequantize(r.quantized(d)[:-1] // r.weights[d], r.config)
        for d in r.session.participants
    ) / sum(r.weights.values())
    mean = result.mean(r.config)
    assert mean.dtype == np.float32
    np.testing.assert_allclose(mean, plain.astype(np.float32), rtol=0, atol=1e-6)
    # and the quantization error against the clipped float updates is within one grid step
    step = 2 * r.config.clip / (2**r.config.quantization_bits - 1)
    c = r.config.clip
    fedavg = sum(
        r.weights[d] * np.clip(r.updates[d].astype(np.float64), -c, c) for d in r.updates
    ) / sum(r.weights.values())
    assert np.max(np.abs(mean - fedavg)) <= step


def test_three_of_ten_dropping_after_masked_input_still_unmask() -> None:
    r = make_round(10, length=200)
    dropped = r.session.participants[2:5]
    result = run_in_process(
        r.config, r.session, r.devices, r.server, {d: Stage.MASKED_INPUT for d in dropped}
    )
    # they sent masked inputs, so they are in the sum; they only skipped unmasking
    np.testing.assert_array_equal(result.values, r.plain_sum(r.session.participants)[:-1])


def test_dropouts_before_masking_leave_the_sum_of_the_others() -> None:
    r = make_round(10, length=200)
    drops = {r.session.participants[0]: Stage.SHARE, r.session.participants[7]: Stage.SHARE}
    result = run_in_process(r.config, r.session, r.devices, r.server, drops)
    alive = tuple(d for d in r.session.participants if d not in drops)
    assert result.survivors == alive
    np.testing.assert_array_equal(result.values, r.plain_sum(alive)[:-1])
    assert result.total_weight == sum(r.weights[d] for d in alive)


def test_dropping_below_t_in_a_neighbourhood_fails_cleanly() -> None:
    r = make_round(10, length=50)
    k, t = r.config.neighbours, r.config.threshold
    victim = r.session.participants[0]
    around = sorted(neighbourhoods(r.session, k)[victim])
    drops = {d: Stage.SHARE for d in around[: k - t + 1]}  # t - 1 neighbours left
    with pytest.raises(SecAggAborted) as err:
        run_in_process(r.config, r.session, r.devices, r.server, drops)
    assert err.value.reason == "too few survivors"
    with pytest.raises(SecAggAborted):  # and the round stays over
        r.server.result()


@pytest.mark.parametrize("n", [2, 3])
def test_two_and_three_devices(n: int) -> None:
    r = make_round(n, length=17)
    assert r.config.neighbours == n - 1
    result = run_in_process(r.config, r.session, r.devices, r.server)
    np.testing.assert_array_equal(result.values, r.plain_sum(r.session.participants)[:-1])


def test_three_devices_cannot_lose_one_at_masking_with_t_two() -> None:
    r = make_round(3, length=5)
    assert r.config.threshold == 2
    with pytest.raises(SecAggAborted):
        run_in_process(
            r.config, r.session, r.devices, r.server, {r.session.participants[0]: Stage.SHARE}
        )


def test_config_refuses_a_modulus_the_sum_could_overflow() -> None:
    config = SecAggConfig(8, 5, 1.0, 16, 40, 30.0, max_weight=2**20)
    with pytest.raises(ConfigError, match="overflow modulus_bits=40; raise it to 43"):
        config.check(100, 1000)
    config.check(9, 1000)  # 9 * 2**20 * (2**16 - 1) < 2**40
    assert issubclass(ConfigError, SpecError)


@pytest.mark.parametrize(
    ("kwargs", "devices", "match"),
    [
        ({"neighbours": 4, "threshold": 5}, 10, "threshold <= neighbours"),
        ({"neighbours": 5, "threshold": 3}, 10, "must be even"),
        ({"neighbours": 12, "threshold": 3}, 10, "only 9 other devices"),
    ],
)
def test_config_refuses_impossible_graphs(kwargs: dict[str, int], devices: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SecAggConfig(
            clip=1.0, quantization_bits=8, modulus_bits=40, stage_timeout_s=1.0, **kwargs
        ).check(devices, 10)


def test_automatic_parameters_from_the_privacy_section() -> None:
    assert [auto_neighbours(n) for n in (2, 3, 4, 10, 50, 100, 200)] == [1, 2, 3, 8, 12, 14, 16]
    config = SecAggConfig.from_privacy(PrivacySection(secure_aggregation=True), 100)
    assert (config.neighbours, config.threshold) == (14, 8)
    given = SecAggConfig.from_privacy(PrivacySection(neighbours=6, threshold=4), 100)
    assert (given.neighbours, given.threshold) == (6, 4)
    with pytest.raises(ConfigError):
        SecAggConfig.from_privacy(PrivacySection(), 1)


def test_everyone_derives_the_same_ring_and_it_depends_on_job_and_round() -> None:
    ids = tuple(f"d{i}" for i in range(40))
    a = ring(Session("job", 1, ids))
    assert ring(Session("job", 1, tuple(reversed(ids)))) == a
    assert sorted(a) == sorted(ids)
    assert ring(Session("job", 2, ids)) != a
    assert ring(Session("other", 1, ids)) != a
    nbr = neighbourhoods(Session("job", 1, ids), 6)
    assert all(len(v) == 6 and d not in v for d, v in nbr.items())
    assert all(d in nbr[e] for d, v in nbr.items() for e in v)  # symmetric
