"""Device conditions and job eligibility, piece by piece: the one judge, the spec sections,
selection in the pool and arbiter, the conditions an agent reads, the wire both ways."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from flotilla.client.conditions import ConditionsFile, read_conditions_file, system_conditions
from flotilla.core.conditions import DeviceConditions
from flotilla.core.device import DeviceProfile
from flotilla.core.eligibility import EligibilitySection, ineligibility
from flotilla.core.errors import SpecError, WireError
from flotilla.core.round_config import RoundConfig
from flotilla.core.spec import JobSpec
from flotilla.engine.plan import JobPlan, validate_spec
from flotilla.proto.conditions import conditions_from_pb, conditions_to_pb
from flotilla.scheduling import Arbiter, DevicePool, RandomSelector

PLUGGED = DeviceConditions(charging=True, battery=0.9, network="unmetered", idle=True)
PHONE = DeviceProfile("d", tasks=("t",), gflops=5.0, memory_bytes=2**30, device_class="phone")


@pytest.mark.parametrize(
    ("policy", "conditions", "profile", "reason"),
    [
        (EligibilitySection(), DeviceConditions(), None, None),
        (EligibilitySection(require_charging=True), PLUGGED, PHONE, None),
        (
            EligibilitySection(require_charging=True),
            DeviceConditions(charging=False),
            None,
            "not charging",
        ),
        (EligibilitySection(require_charging=True), DeviceConditions(), None, "charging unknown"),
        (
            EligibilitySection(require_unmetered=True),
            DeviceConditions(network="metered"),
            None,
            "network metered, unmetered required",
        ),
        (
            EligibilitySection(require_unmetered=True),
            DeviceConditions(),
            None,
            "network unknown, unmetered required",
        ),
        (EligibilitySection(require_idle=True), DeviceConditions(idle=False), None, "not idle"),
        (EligibilitySection(require_idle=True), DeviceConditions(), None, "idleness unknown"),
        (
            EligibilitySection(min_battery=0.5),
            DeviceConditions(battery=0.2),
            None,
            "battery 20%, below min_battery 50%",
        ),
        (EligibilitySection(min_battery=0.5), DeviceConditions(), None, "battery level unknown"),
        (EligibilitySection(min_battery=0.5), DeviceConditions(battery=0.5), None, None),
        (
            EligibilitySection(device_classes=("sbc", "laptop")),
            PLUGGED,
            PHONE,
            "device class 'phone' is not one of sbc, laptop",
        ),
        (
            EligibilitySection(device_classes=("phone",)),
            PLUGGED,
            DeviceProfile("d"),
            "device class 'unset' is not one of phone",
        ),
        (
            EligibilitySection(min_gflops=10.0),
            PLUGGED,
            PHONE,
            "measured 5 GFLOP/s, below min_gflops 10",
        ),
        (
            EligibilitySection(min_memory_bytes=2**31),
            PLUGGED,
            PHONE,
            f"{2**30} bytes of memory, below min_memory_bytes {2**31}",
        ),
        (
            EligibilitySection(
                require_charging=True,
                require_unmetered=True,
                require_idle=True,
                min_battery=0.8,
                device_classes=("phone",),
                min_gflops=1.0,
                min_memory_bytes=1,
            ),
            PLUGGED,
            PHONE,
            None,
        ),
    ],
)
def test_the_judge_names_the_first_rule_a_device_breaks(
    policy: EligibilitySection,
    conditions: DeviceConditions,
    profile: DeviceProfile | None,
    reason: str | None,
) -> None:
    assert ineligibility(policy, profile, conditions) == reason


def test_an_eligibility_section_is_read_checked_and_sent_to_devices() -> None:
    spec = JobSpec.from_dict(
        {"eligibility": {"require_charging": True, "min_battery": 0.3, "device_classes": ["sbc"]}}
    )
    assert spec.eligibility == EligibilitySection(
        require_charging=True, min_battery=0.3, device_classes=("sbc",)
    )
    assert JobSpec.from_json(spec.to_json()) == spec
    config_json = JobPlan.from_spec(spec).client_config_json((), {})
    assert json.loads(config_json)["eligibility"]["require_charging"] is True
    assert RoundConfig.from_json(config_json).eligibility == spec.eligibility


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"require_charging": "yes"}, "'eligibility.require_charging' must be true or false"),
        ({"min_battery": 1.5}, "eligibility.min_battery must be within 0..1"),
        ({"min_gflops": -1}, "eligibility.min_gflops must be >= 0"),
        ({"min_memory_bytes": -1}, "eligibility.min_memory_bytes must be >= 0"),
        ({"device_classes": "phone"}, "'eligibility.device_classes' must be a list"),
        ({"require_wifi": True}, "unknown field 'eligibility.require_wifi'"),
    ],
)
def test_a_bad_eligibility_section_is_refused_by_name(section: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        JobSpec.from_dict({"eligibility": section}, "job.toml")


def test_uplink_by_mbps_picks_the_highest_tier_a_device_reaches() -> None:
    spec = JobSpec.from_dict(
        {
            "compression": {
                "uplink": "topk",
                "uplink_params": {"fraction": 0.05},
                "uplink_by_mbps": [[1.0, "topk"], [5, "int8"]],
            }
        }
    )
    comp = spec.compression
    assert comp.uplink_by_mbps == ((1.0, "topk"), (5.0, "int8"))
    mbit = 1e6 / 8  # bytes per second in one Mbit/s
    assert comp.uplink_for(10 * mbit) == comp.uplink_for(5 * mbit) == "int8"
    assert comp.uplink_for(2 * mbit) == "topk"
    assert comp.uplink_for(0.5 * mbit) == comp.uplink_for(0.0) == "topk"  # below: uplink
    plan = JobPlan.from_spec(spec)
    assert plan.uplink_for(10 * mbit).name == "int8"
    assert plan.uplinks["topk"] is plan.uplink  # the uplink's own parameters
    assert JobSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize(
    ("compression", "message"),
    [
        ({"uplink_by_mbps": [[5.0, "zip"]]}, r"uplink_by_mbps\[0\]: unknown codec 'zip'"),
        ({"uplink_by_mbps": [[0.0, "int8"]]}, "thresholds must be finite numbers of Mbit/s > 0"),
        ({"uplink_by_mbps": [[1.0, "int8"], [1.0, "fp16"]]}, "a threshold appears twice"),
        ({"uplink_by_mbps": [[5.0]]}, r"'compression.uplink_by_mbps\[0\]' must be a list of 2"),
        ({"uplink_by_mbps": [["fast", "int8"]]}, r"uplink_by_mbps\[0\]\[0\]' must be a number"),
        ({"uplink_by_mbps": [[5.0, 8]]}, r"uplink_by_mbps\[0\]\[1\]' must be a string"),
        ({"uplink_by_mbps": 5.0}, "'compression.uplink_by_mbps' must be a list"),
    ],
)
def test_a_bad_uplink_by_mbps_is_refused_at_submission(compression: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        validate_spec(JobSpec.from_dict({"compression": compression}, "job.toml"))


def test_server_less_rounds_refuse_per_device_codecs() -> None:
    spec = JobSpec.from_dict(
        {
            "aggregation": {"transport": "p2p"},
            "compression": {"uplink_by_mbps": [[5.0, "int8"]]},
        }
    )
    with pytest.raises(SpecError, match="without error_feedback or uplink_by_mbps"):
        validate_spec(spec)


def _pool() -> DevicePool:
    pool = DevicePool(lambda: 0.0)
    for name in ("charged", "unplugged", "silent"):
        pool.seen(DeviceProfile(name, tasks=("t",)))
    pool.report("charged", DeviceConditions(charging=True))
    pool.report("unplugged", DeviceConditions(charging=False))
    return pool


def test_the_pool_and_arbiter_never_offer_an_ineligible_device() -> None:
    pool, policy = _pool(), EligibilitySection(require_charging=True)
    assert [p.device_id for p in pool.idle("t", policy)] == ["charged"]
    assert [p.device_id for p in pool.eligible("t", policy)] == ["charged"]
    assert len(pool.idle("t")) == 3, "without a policy every device with the task"
    arbiter = Arbiter(pool, lambda: 0.0)
    for seed in range(20):
        grant = arbiter.grant_now("job", "t", 3, RandomSelector(random.Random(seed)), policy)
        assert grant is not None and grant.devices == ["charged"]
        arbiter.release(grant)
    views = {v.device_id: v for v in pool.describe("t", policy)}
    assert (views["charged"].state, views["charged"].reason) == ("idle", "")
    assert (views["unplugged"].state, views["unplugged"].reason) == ("ineligible", "not charging")
    assert views["silent"].reason == "charging unknown"
    assert views["unplugged"].conditions == DeviceConditions(charging=False)


async def test_a_waiting_job_gets_only_devices_its_policy_admits() -> None:
    from flotilla.scheduling import DeviceRequest

    pool = _pool()
    arbiter = Arbiter(pool, lambda: 0.0, grace_s=0.0)
    policy = EligibilitySection(require_charging=True)
    request = DeviceRequest("job", "t", 3, 1, RandomSelector(random.Random(0)), policy)
    grant = await arbiter.acquire(request)
    assert grant.devices == ["charged"] and grant.candidates == 1
    await arbiter.close()


def test_a_conditions_file_is_read_strictly_and_reread(tmp_path: Path) -> None:
    path = tmp_path / "conditions.json"
    path.write_text('{"charging": true, "battery": 0.8, "network": "unmetered", "idle": true}')
    source = ConditionsFile(path)
    assert source() == DeviceConditions(True, 0.8, "unmetered", True)
    path.write_text('{"charging": false, "battery": 0.5, "network": "metered"}')
    assert source() == DeviceConditions(False, 0.5, "metered", None)
    path.write_text('{"charging": fal')  # caught half-written: the last good reading
    assert source() == DeviceConditions(False, 0.5, "metered", None)
    for text, message in [
        ("[1]", "expected a JSON object"),
        ('{"charging": "yes"}', "charging must be true, false or null"),
        ('{"battery": 80}', "battery must be within 0..1"),
        ('{"network": "5g"}', "network must be one of unmetered, metered, unknown"),
        ('{"plugged": true}', r"unknown field\(s\) plugged"),
        ("not json", "not valid JSON"),
    ]:
        path.write_text(text)
        with pytest.raises(WireError, match=message):
            read_conditions_file(path)
    with pytest.raises(WireError, match=r"conditions file .*missing\.json"):
        ConditionsFile(tmp_path / "missing.json")


def _supply(root: Path, name: str, **files: str) -> None:
    (root / name).mkdir(parents=True)
    for key, value in files.items():
        (root / name / key).write_text(value + "\n")


def test_the_os_conditions_come_from_power_supply(tmp_path: Path) -> None:
    laptop = tmp_path / "laptop"
    _supply(laptop, "AC", type="Mains", online="0")
    _supply(laptop, "BAT0", type="Battery", capacity="42", status="Discharging")
    assert system_conditions(laptop) == DeviceConditions(charging=False, battery=0.42)
    (laptop / "AC" / "online").write_text("1\n")
    assert system_conditions(laptop).charging is True
    phone = tmp_path / "phone"
    _supply(phone, "battery", type="Battery", capacity="100", status="Full")
    assert system_conditions(phone) == DeviceConditions(charging=True, battery=1.0)
    said = system_conditions(tmp_path / "none")  # no supplies: psutil's, or unknown
    assert said.network == "unknown" and said.idle is None


@pytest.mark.parametrize(
    "conditions",
    [DeviceConditions(), PLUGGED, DeviceConditions(False, 0.0, "metered", False, "critical")],
)
def test_conditions_cross_the_wire_unchanged(conditions: DeviceConditions) -> None:
    assert conditions_from_pb(conditions_to_pb(conditions)) == conditions
