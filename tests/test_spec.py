"""Job specs: TOML in, every field defaulted, every mistake named by field and file."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from flotilla.core.errors import SpecError
from flotilla.core.spec import (
    AggregationSection,
    DataSection,
    JobSection,
    JobSpec,
    TrainSection,
    apply_override,
)

DIGITS = Path(__file__).resolve().parents[1] / "examples" / "digits.toml"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def _raises(match: str, *also: str) -> Any:
    """pytest.raises(SpecError) whose message holds every part, in order."""
    return pytest.raises(SpecError, match=".*".join(re.escape(m) for m in (match, *also)))


def test_load_the_digits_example() -> None:
    spec = JobSpec.load(DIGITS)
    assert spec.job.name == "digits"
    assert spec.job.task == "flotilla.tasks.digits:DigitsTask"
    assert (spec.job.rounds, spec.job.clients_per_round, spec.job.min_quorum) == (20, 4, 2)
    assert spec.train.learning_rate == 0.05 and spec.train.momentum == 0.9
    assert spec.train.weight_decay == 0.0  # not in the file: the default
    assert spec.data.alpha == 0.5
    assert spec.aggregation.strategy == "fedavg"


def test_packaged_example_matches_the_repository_one() -> None:
    import flotilla

    packaged = Path(flotilla.__file__).parent / "examples" / "digits.toml"
    assert JobSpec.load(packaged) == JobSpec.load(DIGITS)


def test_every_field_has_a_default(tmp_path: Path) -> None:
    spec = JobSpec()
    for section in (JobSection, TrainSection, DataSection, AggregationSection):
        for field in dataclasses.fields(section):
            has_default = field.default is not dataclasses.MISSING
            assert has_default or field.default_factory is not dataclasses.MISSING, field.name
    assert JobSpec.from_dict({}) == spec
    assert JobSpec.load(_write(tmp_path, "")) == spec
    assert JobSpec.load(_write(tmp_path, "[job]\n[train]\n")) == spec


def test_ints_are_accepted_where_floats_are_expected(tmp_path: Path) -> None:
    spec = JobSpec.load(_write(tmp_path, "[train]\nlearning_rate = 1\n"))
    assert spec.train.learning_rate == 1.0 and isinstance(spec.train.learning_rate, float)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[jobs]\nrounds = 3\n", "'jobs'"),
        ("seed = 3\n", "'seed'"),
        ("[job]\nround = 3\n", "'job.round'"),
        ("[train]\nlearning_rat = 0.1\n", "'train.learning_rat'"),
        ("[aggregation]\nstrategy = 'fedavg'\nclip = 1.0\n", "'aggregation.clip'"),
        ("[compression]\nuplink = 'int8'\nerrorfeedback = true\n", "'compression.errorfeedback'"),
    ],
)
def test_unknown_fields_are_named_with_the_file(tmp_path: Path, text: str, field: str) -> None:
    path = _write(tmp_path, text)
    with _raises(str(path), f"unknown field {field}"):
        JobSpec.load(path)


@pytest.mark.parametrize(
    ("text", "field", "kind"),
    [
        ('[job]\nrounds = "20"\n', "job.rounds", "integer"),
        ("[job]\nrounds = true\n", "job.rounds", "integer"),
        ("[job]\nrounds = 2.5\n", "job.rounds", "integer"),
        ("[job]\nclients_per_round = 4.0\n", "job.clients_per_round", "integer"),
        ('[train]\nlearning_rate = "fast"\n', "train.learning_rate", "number"),
        ("[train]\nlearning_rate = false\n", "train.learning_rate", "number"),
        ("[job]\nname = 3\n", "job.name", "string"),
        ("[data]\nseed = [1]\n", "data.seed", "integer"),
        ("job = 3\n", "job", "must be a table"),
    ],
)
def test_ill_typed_fields_are_named(tmp_path: Path, text: str, field: str, kind: str) -> None:
    path = _write(tmp_path, text)
    with _raises(str(path), f"'{field}'" if kind != "must be a table" else field, kind):
        JobSpec.load(path)


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with _raises(str(tmp_path / "nope.toml"), "no such file"):
        JobSpec.load(tmp_path / "nope.toml")
    path = _write(tmp_path, "[job\nrounds = 3\n")
    with _raises(str(path), "not valid TOML"):
        JobSpec.load(path)


# --- overrides ----------------------------------------------------------------------------------


def test_overrides_of_each_type() -> None:
    spec = JobSpec.load(
        DIGITS,
        [
            "job.rounds=5",
            "train.learning_rate = 0.1",
            "data.alpha=2",
            "job.name=hello",
            'job.task="pkg.mod:Task"',
            "aggregation.params.server_lr=0.5",
            "compression.uplink_params.fraction=0.05",
        ],
    )
    assert spec.job.rounds == 5
    assert spec.train.learning_rate == 0.1
    assert spec.data.alpha == 2.0
    assert spec.job.name == "hello"
    assert spec.job.task == "pkg.mod:Task"
    assert spec.aggregation.params == {"server_lr": 0.5}
    assert spec.compression.uplink_params == {"fraction": 0.05}
    assert spec.train.momentum == 0.9  # untouched fields keep the file's values


def test_unquoted_values_that_are_not_toml_stay_strings() -> None:
    data: dict = {}
    apply_override(data, "job.task=flotilla.tasks.digits:DigitsTask")
    apply_override(data, "job.name=a=b")
    assert data == {"job": {"task": "flotilla.tasks.digits:DigitsTask", "name": "a=b"}}


def test_override_creates_missing_sections() -> None:
    data: dict = {"job": {"rounds": 3}}
    apply_override(data, "aggregation.strategy=fedadam")
    apply_override(data, "job.seed=7")
    assert data == {"job": {"rounds": 3, "seed": 7}, "aggregation": {"strategy": "fedadam"}}
    assert JobSpec.from_dict(data).aggregation.strategy == "fedadam"


@pytest.mark.parametrize("item", ["job.rounds", "=5", " =5", ""])
def test_bad_override_syntax(item: str) -> None:
    with _raises("--set", "must look like section.field=value"):
        apply_override({}, item, "--set")


def test_override_through_a_value_that_is_not_a_table() -> None:
    with _raises("'job.rounds.x'", "'rounds' is not a table"):
        apply_override({"job": {"rounds": 3}}, "job.rounds.x=5")


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("job.rounds=abc", "'job.rounds' must be an integer"),
        ("job.roundz=3", "unknown field 'job.roundz'"),
        ("jobs.rounds=3", "unknown field 'jobs'"),
    ],
)
def test_overrides_are_checked_like_the_file(item: str, message: str) -> None:
    with _raises(str(DIGITS), message):
        JobSpec.load(DIGITS, [item])


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("job.rounds=0", "job.rounds must be a finite number > 0"),
        ("job.clients_per_round=-1", "job.clients_per_round must be"),
        ("job.round_deadline_s=inf", "job.round_deadline_s must be a finite number"),
        ("train.learning_rate=nan", "train.learning_rate must be a finite number"),
        ("job.min_quorum=5", "job.min_quorum (5) exceeds job.clients_per_round (4)"),
        ("job.over_selection=0.5", "job.over_selection must be >= 1.0"),
        ("job.task=nocolon", "job.task must look like 'package.module:Name'"),
        ("train.update_momentum=1.0", "train.update_momentum must be in [0, 1)"),
        ("train.proximal_mu=-1", "train.proximal_mu must be >= 0"),
    ],
)
def test_invalid_values_are_refused(override: str, message: str) -> None:
    with _raises(str(DIGITS), message):
        JobSpec.load(DIGITS, [override])


def test_validation_also_guards_direct_construction() -> None:
    with _raises("job.rounds"):
        JobSpec(job=JobSection(rounds=0))


# --- JSON -----------------------------------------------------------------------------------


def test_json_round_trip() -> None:
    spec = JobSpec.load(DIGITS, ["job.rounds=3", "train.weight_decay=0.01", "job.name=x y"])
    again = JobSpec.from_json(spec.to_json())
    assert again == spec
    assert again.to_json() == spec.to_json()


@pytest.mark.parametrize(
    ("text", "message"),
    [("{", "not valid JSON"), ("[1]", "must be a table"), ('{"job": {"x": 1}}', "'job.x'")],
)
def test_from_json_refuses_bad_input(text: str, message: str) -> None:
    with _raises("<db>", message):
        JobSpec.from_json(text, source="<db>")


@pytest.mark.parametrize(
    ("override", "message"),
    [("train.momentum=-0.1", "train.momentum"), ("train.momentum=1.0", "train.momentum"),
     ("train.weight_decay=-1", "train.weight_decay")],
)  # fmt: skip
def test_optimizer_ranges_are_checked(override: str, message: str) -> None:
    data: dict = {}
    apply_override(data, override)
    with pytest.raises(SpecError, match=message):
        JobSpec.from_dict(data)


def test_a_date_like_override_stays_text() -> None:
    data: dict = {}
    apply_override(data, "job.name=1979-05-27")
    assert JobSpec.from_dict(data).job.name == "1979-05-27"


# --- strategy and codec names, checked where the engine builds them ---------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("aggregation.strategy=fedmedian", "valid: fedavg, fedprox"),
        ("aggregation.params.betaa=0.1", "aggregation.params (fedadam): unknown field 'betaa'"),
        ("compression.uplink=int9", "compression.uplink"),
        ("compression.uplink_params.fraction=0.1", "compression.uplink"),
        ("compression.downlink=gzip", "compression.downlink"),
    ],
)
def test_unknown_strategies_codecs_and_params_are_refused(override: str, message: str) -> None:
    from flotilla.engine import validate_spec

    spec = JobSpec.load(DIGITS, ["aggregation.strategy=fedadam", override])
    with pytest.raises(SpecError, match=re.escape(message)):
        validate_spec(spec)


def test_every_strategy_and_codec_is_reachable_by_name() -> None:
    from flotilla.aggregation import STRATEGY_NAMES
    from flotilla.compression import CODEC_NAMES
    from flotilla.engine import JobPlan

    for name in STRATEGY_NAMES:
        plan = JobPlan.from_spec(JobSpec.load(DIGITS, [f"aggregation.strategy={name}"]))
        assert plan.spec.aggregation.strategy == name
    for name in CODEC_NAMES:
        plan = JobPlan.from_spec(JobSpec.load(DIGITS, [f"compression.uplink={name}"]))
        assert plan.uplink.name == name


def test_table_params_hold_scalars_only() -> None:
    with pytest.raises(SpecError, match=re.escape("'aggregation.params.x'")):
        JobSpec.from_dict({"aggregation": {"params": {"x": {"nested": 1}}}})
