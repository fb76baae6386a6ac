"""Job specs: TOML files mapped onto frozen dataclasses, every field defaulted and checked.

Unknown or ill-typed fields raise :class:`SpecError` naming the field and the file, so a
typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from flotilla.core.eligibility import EligibilitySection
from flotilla.core.errors import SpecError
from flotilla.core.tables import build_dataclass

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class JobSection:
    """What to train and for how long."""

    name: str = "job"
    #: Task entry point installed on the agents (and optionally the server).
    task: str = "flotilla.tasks.digits:DigitsTask"
    #: Rounds to commit before the job completes.
    rounds: int = 20
    #: Updates a round waits for before it closes (k).
    clients_per_round: int = 4
    #: Devices selected per round = ceil(k * over_selection), capped by what is idle.
    over_selection: float = 1.0
    #: Fewest accepted updates with which a round may still commit at its deadline.
    min_quorum: int = 2
    #: Seconds a round stays open before it closes with what it has.
    round_deadline_s: float = 60.0
    #: Seed for the server-side RNG (selection) and the model initialisation.
    seed: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class TrainSection:
    """Local training on each device."""

    local_epochs: int = 1
    batch_size: int = 32
    learning_rate: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    #: FedProx's proximal term: the local loss adds mu/2 * ||w - w_global||^2. The
    #: ``fedprox`` strategy sets it from ``aggregation.params.mu``.
    proximal_mu: float = 0.0
    #: Agent-side momentum over rounds: each device sends m = beta*m + (1-beta)*delta
    #: instead of delta (kept in its state dir). Steadies robust rules such as centered
    #: clipping against Byzantine devices; 0 sends the plain delta.
    update_momentum: float = 0.0
    #: Task-specific parameters, passed to the task as they are (scalars only).
    params: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class DataSection:
    """How the task's data is split across devices (non-IID label skew)."""

    #: Dirichlet concentration of label skew; small is more skewed.
    alpha: float = 0.5
    #: Seed of the partition, shared by every agent so shards are disjoint.
    seed: int = 0
    #: Task-specific parameters (scalars), e.g. ``{augment = true}`` for digits.
    params: dict[str, Any] = dataclasses.field(default_factory=dict)

    def key(self) -> str:
        """A hashable identity: equal sections give equal keys (``params`` is a dict)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


@dataclasses.dataclass(frozen=True, slots=True)
class AggregationSection:
    """How accepted updates become the next global model."""

    #: One of ``flotilla.aggregation.STRATEGY_NAMES`` (docs/aggregation.md): ``fedavg``,
    #: ``fedprox``, ``fedavgm``, ``fedadam``, ``fedyogi``, ``fedadagrad``, ``median``,
    #: ``trimmed_mean``, ``krum``, ``multikrum``, ``centered_clipping``, ``dp_fedavg``,
    #: ``fedbuff`` (asynchronous: ``job.clients_per_round`` devices train at once).
    strategy: str = "fedavg"
    #: The strategy's parameters, e.g. ``{eta = 0.01, tau = 1e-3}`` for ``fedadam``; a name
    #: the strategy does not know is an error listing the ones it does.
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: ``server``: devices upload updates and the server aggregates. ``p2p``: the round's
    #: devices all-reduce their updates among themselves over hivemind, a quorum of them
    #: report the new model's hash and one uploads it (docs/p2p.md; ``fedavg`` or
    #: ``fedprox``, uplink ``none``, ``fp16`` or ``int8``; needs the ``p2p`` extra).
    transport: str = "server"
    #: ``p2p`` only: seconds the round's devices wait for each other before averaging
    #: with whoever is there (at least ``job.min_quorum`` of them).
    matchmaking_s: float = 15.0


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulingSection:
    """Which devices a round gets (docs/scheduling.md). The deadline and over-selection
    it works with are ``job.round_deadline_s`` and ``job.over_selection``."""

    #: One of ``flotilla.scheduling.SELECTOR_NAMES``: ``random``, ``fedcs``, ``greedy``,
    #: ``oort``, ``rl``, ``bayesian``. ``greedy`` is the default: the best one measured
    #: (docs/scheduling.md), faster than random at equal accuracy and near its fairness.
    selector: str = "greedy"
    #: The selector's parameters, e.g. ``{exploration = 0.5}`` for ``oort``; a name the
    #: selector does not know is an error listing the ones it does.
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Weights of the job's scheduling cost ``alpha * T + beta * F``: T the predicted round
    #: time (seconds), F the variance of how often each device was selected. One more
    #: selection of a device picked c times adds about (2c + 1) / N to F among N
    #: candidates, so beta ~ 3 N keeps fairness near random's (3000 for ~1,000 devices).
    alpha: float = 1.0
    beta: float = 3000.0
    #: Select ``clients_per_round / (1 - the job's observed failure rate)`` devices, at
    #: most ``clients_per_round * job.over_selection`` (which then is the cap, not the rule).
    adaptive_over_selection: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class CompressionSection:
    """How updates shrink on the uplink and the model on the downlink (docs/compression.md)."""

    #: Codec for device -> server updates: one of ``flotilla.compression.CODEC_NAMES``.
    uplink: str = "none"
    #: That codec's parameters, e.g. ``{fraction = 0.01}`` for ``topk``.
    uplink_params: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Keep what the codec dropped on the device and add it to the next update.
    error_feedback: bool = False
    #: Codec for the model broadcast; ``none`` sends the exact model.
    downlink: str = "none"
    downlink_params: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Send devices that hold the previous broadcast only the downlink-compressed change
    #: since it; others download the whole model. Needs a lossy ``downlink`` codec.
    downlink_delta: bool = False
    #: Per-device uplink codecs by measured uplink: ``[[5.0, "int8"], [1.0, "topk"]]``
    #: gives a device measured at >= 5 Mbit/s ``int8``, one at >= 1 Mbit/s ``topk``, and
    #: one below every threshold (or never measured) ``uplink``. A tier's codec takes
    #: ``uplink_params`` when it is ``uplink`` itself, else its defaults.
    uplink_by_mbps: tuple[tuple[float, str], ...] = ()

    def __post_init__(self) -> None:
        for mbps, codec in self.uplink_by_mbps:
            if not (math.isfinite(mbps) and mbps > 0):
                raise SpecError(
                    f"compression.uplink_by_mbps: thresholds must be finite numbers of "
                    f"Mbit/s > 0, got {mbps!r} for {codec!r}"
                )
        thresholds = [mbps for mbps, _ in self.uplink_by_mbps]
        if len(set(thresholds)) != len(thresholds):
            raise SpecError("compression.uplink_by_mbps: a threshold appears twice")

    def uplink_for(self, upload_bytes_per_s: float) -> str:
        """The uplink codec a device measured at ``upload_bytes_per_s`` gets: the tier with
        the highest threshold it reaches, else ``uplink``."""
        mbps = upload_bytes_per_s * 8 / 1e6
        reached = [(t, codec) for t, codec in self.uplink_by_mbps if mbps >= t]
        return max(reached)[1] if reached else self.uplink

    def uplink_params_of(self, codec: str) -> dict[str, Any]:
        """The parameters ``codec`` takes as a device's uplink codec."""
        return dict(self.uplink_params) if codec == self.uplink else {}


@dataclasses.dataclass(frozen=True, slots=True)
class PrivacySection:
    """What the server may see of each device's update (docs/secure-aggregation.md).

    With ``secure_aggregation`` the round runs SecAgg+ (Bell et al., CCS 2020): each device
    clips and quantizes its update, masks it with its ``neighbours`` on a shuffled ring, and
    the server learns only the weighted sum of the round's updates."""

    secure_aggregation: bool = False
    #: k, how many neighbours each device masks with; 0: chosen from the round's size
    #: (about 2 log2 n, even, at most n - 1).
    neighbours: int = 0
    #: t, how many of a device's neighbours must survive to unmask; 0: chosen from k.
    threshold: int = 0
    #: Each element of an update is clipped to [-clip, clip] before it is quantized.
    clip: float = 1.0
    #: Quantized values are integers in [0, 2**quantization_bits - 1] (stochastic rounding).
    quantization_bits: int = 16
    #: Masked arithmetic is modulo 2**modulus_bits; it must hold the sum without overflow.
    modulus_bits: int = 62
    #: How long the server waits for each stage's messages before it closes the stage.
    stage_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.neighbours < 0 or self.threshold < 0:
            raise SpecError("privacy.neighbours and privacy.threshold must be >= 0 (0: automatic)")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise SpecError(f"privacy.clip must be a finite number > 0, got {self.clip!r}")
        if not 1 <= self.quantization_bits <= 32:
            raise SpecError(
                f"privacy.quantization_bits must be in [1, 32], got {self.quantization_bits!r}"
            )
        if not self.quantization_bits < self.modulus_bits <= 64:
            raise SpecError(
                f"privacy.modulus_bits must be in (quantization_bits, 64], got "
                f"{self.modulus_bits!r}"
            )
        if not (math.isfinite(self.stage_timeout_s) and self.stage_timeout_s > 0):
            raise SpecError(f"privacy.stage_timeout_s must be > 0, got {self.stage_timeout_s!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class EvaluationSection:
    """How each committed model is scored."""

    #: Score the model on the task's held-out split where the round commits (the server,
    #: or the simulator). Off, or when the task cannot be imported there, a round's
    #: ``accuracy`` and ``loss`` are the devices' own validation, weighted by samples.
    server: bool = True
    #: Score on the server every this many rounds (and always the last round).
    every: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise SpecError(f"evaluation.every must be an integer >= 1, got {self.every!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class JobSpec:
    """A whole federated job, as submitted."""

    job: JobSection = dataclasses.field(default_factory=JobSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    aggregation: AggregationSection = dataclasses.field(default_factory=AggregationSection)
    compression: CompressionSection = dataclasses.field(default_factory=CompressionSection)
    scheduling: SchedulingSection = dataclasses.field(default_factory=SchedulingSection)
    #: Which devices may be selected (charging, unmetered, idle, battery, class, speed).
    eligibility: EligibilitySection = dataclasses.field(default_factory=EligibilitySection)
    #: Secure aggregation (SecAgg+) and its parameters.
    privacy: PrivacySection = dataclasses.field(default_factory=PrivacySection)
    #: Server-side scoring of each committed model.
    evaluation: EvaluationSection = dataclasses.field(default_factory=EvaluationSection)

    def __post_init__(self) -> None:
        _check_job(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<spec>") -> JobSpec:
        return build_dataclass(cls, data, source)

    @classmethod
    def load(cls, path: str | Path, overrides: Sequence[str] = ()) -> JobSpec:
        """Read a TOML file and apply ``section.field=value`` overrides."""
        path = Path(path)
        data = read_toml(path)
        for item in overrides:
            apply_override(data, item, str(path))
        return cls.from_dict(data, str(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str = "<json>") -> JobSpec:
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:  # bad JSON, 5000-digit ints, nesting
            raise SpecError(f"{source}: not valid JSON: {str(exc)[:200]}") from None
        if not isinstance(data, dict):
            raise SpecError(f"{source}: a job spec must be a table")
        return cls.from_dict(data, source)


def _check_job(spec: JobSpec) -> None:
    job, train = spec.job, spec.train
    positive = {
        "job.rounds": job.rounds,
        "job.clients_per_round": job.clients_per_round,
        "job.min_quorum": job.min_quorum,
        "job.round_deadline_s": job.round_deadline_s,
        "train.local_epochs": train.local_epochs,
        "train.batch_size": train.batch_size,
        "train.learning_rate": train.learning_rate,
        "data.alpha": spec.data.alpha,
    }
    for name, value in positive.items():
        if not value > 0 or not math.isfinite(value):
            raise SpecError(f"{name} must be a finite number > 0, got {value!r}")
    if not 0.0 <= train.momentum < 1.0:
        raise SpecError(f"train.momentum must be in [0, 1), got {train.momentum!r}")
    if not train.weight_decay >= 0.0 or not math.isfinite(train.weight_decay):
        raise SpecError(f"train.weight_decay must be >= 0, got {train.weight_decay!r}")
    if job.over_selection < 1.0 or not math.isfinite(job.over_selection):
        raise SpecError(f"job.over_selection must be >= 1.0, got {job.over_selection!r}")
    if job.min_quorum > job.clients_per_round:
        raise SpecError(
            f"job.min_quorum ({job.min_quorum}) exceeds job.clients_per_round "
            f"({job.clients_per_round})"
        )
    if ":" not in job.task:
        raise SpecError(f"job.task must look like 'package.module:Name', got {job.task!r}")
    if not 0.0 <= train.update_momentum < 1.0:
        raise SpecError(f"train.update_momentum must be in [0, 1), got {train.update_momentum!r}")
    if not train.proximal_mu >= 0.0 or not math.isfinite(train.proximal_mu):
        raise SpecError(f"train.proximal_mu must be >= 0, got {train.proximal_mu!r}")
    sched = spec.scheduling
    for name, value in (("scheduling.alpha", sched.alpha), ("scheduling.beta", sched.beta)):
        if not value >= 0.0 or not math.isfinite(value):
            raise SpecError(f"{name} must be a finite number >= 0, got {value!r}")


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file's tables; a missing or malformed file is a :class:`SpecError`."""
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise SpecError(f"{path}: no such file") from exc
    return parse_toml(text, str(path))


def parse_toml(text: str, source: str) -> dict[str, Any]:
    """TOML text's tables (a file's, or a request body's); malformed: a :class:`SpecError`."""
    try:
        data: dict[str, Any] = tomllib.loads(text)
    except (ValueError, RecursionError) as exc:  # TOMLDecodeError, 5000-digit ints, nesting
        raise SpecError(f"{source}: not valid TOML: {str(exc)[:200]}") from None
    return data


def apply_override(data: dict[str, Any], item: str, source: str = "<overrides>") -> None:
    """Apply one ``a.b=value`` override; the value is read as TOML, else as a string."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise SpecError(f"{source}: override {item!r} must look like section.field=value")
    parts = [p.strip() for p in key.strip().split(".")]
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    if not isinstance(value, (str, int, float, bool, list)):
        value = raw.strip()  # e.g. a TOML date: spec fields never hold one, so keep the text
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise SpecError(f"{source}: override {key!r}: {part!r} is not a table")
        node = child
    node[parts[-1]] = value
