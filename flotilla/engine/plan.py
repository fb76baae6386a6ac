"""A job spec turned into the parts the engine runs: aggregator, codecs, client config.

Building the plan checks every name and parameter in the spec (strategy, codecs), so a
bad spec is refused at submission with an error that lists the valid choices, not at the
first round.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flotilla.aggregation import Aggregator, Traits, make_aggregator, parse_params, strategy_info
from flotilla.compression import Codec, make_codec
from flotilla.core.eligibility import EligibilitySection
from flotilla.core.errors import ConfigError, SpecError
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import TensorSpec
from flotilla.engine.backend import TrainTask
from flotilla.scheduling import selector_params
from flotilla.secagg import SecAggConfig


@dataclass(frozen=True, slots=True)
class JobPlan:
    spec: JobSpec
    traits: Traits
    strategy_params: Any
    uplink: Codec
    #: None: the exact model is broadcast.
    downlink: Codec | None
    #: Every codec ``compression.uplink_by_mbps`` may give a device, by name (with
    #: ``uplink``'s own): what each device's upload is checked against.
    uplinks: Mapping[str, Codec] = field(default_factory=dict)

    @classmethod
    def from_spec(cls, spec: JobSpec) -> JobPlan:
        agg = spec.aggregation
        info = strategy_info(agg.strategy)
        params = parse_params(agg.strategy, agg.params)
        comp = spec.compression
        uplink = _codec("compression.uplink", comp.uplink, comp.uplink_params)
        downlink = _codec("compression.downlink", comp.downlink, comp.downlink_params)
        if comp.error_feedback and uplink.name == "none":
            raise SpecError("compression.error_feedback needs a lossy compression.uplink codec")
        if comp.downlink_delta and downlink.name == "none":
            raise SpecError("compression.downlink_delta needs a lossy compression.downlink codec")
        _check_transport(spec)
        _check_secure(spec, params)
        uplinks = {uplink.name: uplink}
        for i, (_, name) in enumerate(comp.uplink_by_mbps):
            if name not in uplinks:
                uplinks[name] = _codec(
                    f"compression.uplink_by_mbps[{i}]", name, comp.uplink_params_of(name)
                )
        return cls(
            spec,
            info.traits,
            params,
            uplink,
            None if downlink.name == "none" else downlink,
            uplinks,
        )

    def uplink_for(self, upload_bytes_per_s: float) -> Codec:
        """The uplink codec of a device measured at ``upload_bytes_per_s``."""
        return self.uplinks[self.spec.compression.uplink_for(upload_bytes_per_s)]

    def per_device(self, task: TrainTask, uplinks: Mapping[str, float]) -> TrainTask:
        """``task`` with each device's uplink codec chosen by its measured uplink
        (``uplinks``: device -> bytes/s), when the job has ``uplink_by_mbps``."""
        if not self.spec.compression.uplink_by_mbps or task.transport != "server":
            return task
        codecs = {device: self.uplink_for(rate) for device, rate in uplinks.items()}
        return dataclasses.replace(task, device_codecs=codecs)

    @property
    def policy(self) -> EligibilitySection | None:
        """The job's eligibility when conditions can end a device's round (else None)."""
        policy = self.spec.eligibility
        return policy if policy.needs_conditions else None

    def aggregator(self, layout: tuple[TensorSpec, ...], spool_dir: Path | None) -> Aggregator:
        return make_aggregator(
            self.spec.aggregation.strategy, self.strategy_params, layout, spool_dir
        )

    def client_config_json(
        self, layout: tuple[TensorSpec, ...], extra_train: Mapping[str, float]
    ) -> str:
        """What devices get with each task: train, data and compression settings."""
        full = self.spec.to_dict()
        config: dict[str, Any] = {
            "train": {**full["train"], **extra_train},
            "data": full["data"],
            "compression": full["compression"],
            # Devices on every edge stop training when they stop qualifying mid-round.
            "eligibility": self.spec.eligibility.to_dict(),
        }
        if self.downlink is not None:  # codec payloads are decoded against the layout
            config["layout"] = [[s.name, s.dtype, list(s.shape)] for s in layout]
        return json.dumps(config, sort_keys=True)


TRANSPORTS = ("server", "p2p")
#: What agents can average among themselves: the weighted mean, on hivemind's wire codecs.
P2P_STRATEGIES = ("fedavg", "fedprox")
P2P_CODECS = ("none", "fp16", "int8")


def _check_transport(spec: JobSpec) -> None:
    agg, comp = spec.aggregation, spec.compression
    if agg.transport not in TRANSPORTS:
        raise SpecError(
            f"aggregation.transport {agg.transport!r} is not one of {', '.join(TRANSPORTS)}"
        )
    if agg.matchmaking_s <= 0:
        raise SpecError("aggregation.matchmaking_s must be positive")
    if agg.transport != "p2p":
        return
    if agg.strategy not in P2P_STRATEGIES:
        raise SpecError(
            f'aggregation.transport = "p2p" averages on the devices: strategy must be one of '
            f"{', '.join(P2P_STRATEGIES)}, not {agg.strategy!r}"
        )
    if comp.uplink not in P2P_CODECS or comp.error_feedback or comp.uplink_by_mbps:
        raise SpecError(
            f'aggregation.transport = "p2p" compresses with hivemind: compression.uplink must '
            f"be one of {', '.join(P2P_CODECS)}, without error_feedback or uplink_by_mbps"
        )
    if comp.downlink != "none" and not comp.downlink_delta:
        raise SpecError(
            'aggregation.transport = "p2p" needs the exact model on every device: '
            "compression.downlink none, or a lossy one with downlink_delta"
        )
    if agg.matchmaking_s >= spec.job.round_deadline_s:
        raise SpecError("aggregation.matchmaking_s must be shorter than job.round_deadline_s")


#: Strategies whose server side folds a weighted sum, so a securely aggregated sum (its
#: mean, weighted by the total weight) gives them what individual updates would.
SECURE_STRATEGIES = (
    "fedavg",
    "fedprox",
    "fedavgm",
    "fedadam",
    "fedyogi",
    "fedadagrad",
    "dp_fedavg",
)


def _check_secure(spec: JobSpec, params: Any) -> None:
    """Refuse what secure aggregation cannot combine with: rules that need individual
    updates, buffered rounds, server-less rounds, and lossy uplink codecs (SecAgg+
    quantizes the update itself)."""
    if not spec.privacy.secure_aggregation:
        return
    agg, comp = spec.aggregation, spec.compression
    if agg.strategy not in SECURE_STRATEGIES:  # each refusal names the fields at fault
        why = (
            "is asynchronous (buffered rounds)"
            if agg.strategy == "fedbuff"
            else "needs the individual updates"
        )
        raise ConfigError(
            f"privacy.secure_aggregation shows the server only the sum of a round's updates: "
            f"aggregation.strategy {agg.strategy!r} {why}; use one of "
            f"{', '.join(SECURE_STRATEGIES)}"
        )
    if agg.transport != "server":
        raise ConfigError(
            "privacy.secure_aggregation runs through the server: aggregation.transport must be "
            f'"server", not {agg.transport!r}'
        )
    if comp.uplink != "none" or comp.uplink_by_mbps or comp.error_feedback:
        raise ConfigError(
            "privacy.secure_aggregation quantizes the update itself: compression.uplink must "
            'be "none", without uplink_by_mbps or error_feedback'
        )
    if getattr(params, "adaptive_clip", False):
        raise ConfigError(
            "privacy.secure_aggregation hides which updates were clipped: "
            "aggregation.params.adaptive_clip must be false"
        )
    # The round's size decides the automatic neighbours and the sum the modulus must hold.
    devices = max(2, math.ceil(round(spec.job.clients_per_round * spec.job.over_selection, 9)))
    try:
        SecAggConfig.from_privacy(spec.privacy, devices)
    except ConfigError as exc:
        raise ConfigError(f"privacy (a round of up to {devices} devices): {exc}") from exc


def _codec(field: str, name: str, params: Mapping[str, Any]) -> Codec:
    try:
        return make_codec(name, params)
    except SpecError as exc:
        raise SpecError(f"{field}: {exc}") from exc


def validate_spec(spec: JobSpec) -> None:
    """Refuse a spec whose strategy, codecs or selector are unknown or misconfigured."""
    JobPlan.from_spec(spec)
    selector_params(spec.scheduling)
