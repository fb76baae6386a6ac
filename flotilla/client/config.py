"""How an agent is set up, and how it rebuilds a model from a downlink delta.

Kept apart from :mod:`flotilla.client.agent` so that module holds only the agent's loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from flotilla.client.conditions import ConditionsSource
from flotilla.client.secure import DeviceFactory
from flotilla.client.training import LocalTrainer
from flotilla.core.allreduce import GroupAveraging, PeerOptions
from flotilla.core.blobs import sha256_hex
from flotilla.core.errors import FlotillaError
from flotilla.core.round_config import RoundConfig
from flotilla.core.timeouts import Timeouts
from flotilla.core.work import WorkOrder
from flotilla.secagg import SecAggDevice


@dataclass(frozen=True, slots=True)
class AgentConfig:
    server: str
    token: str
    trainer: LocalTrainer
    state_dir: Path | None = None
    tls_ca: Path | None = None
    #: This device's own certificate and key, for a server with mutual TLS; the
    #: certificate's subject CN is the device id the server gives it.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    speed_test_bytes: int = 2 * 1024 * 1024
    backoff_cap_s: float = 5.0
    max_model_bytes: int = 2**32
    #: This device's hivemind peer, for server-less (p2p) rounds.
    p2p: PeerOptions = field(default_factory=PeerOptions)
    #: Makes the device's peer at its first server-less round; None: hivemind's
    #: (``flotilla.p2p.federated``, the ``p2p`` extra).
    averaging: Callable[[PeerOptions], GroupAveraging] | None = None
    #: The device's conditions, read at every poll and heartbeat (``client.conditions``);
    #: None reports none (jobs that require a condition never select the device).
    conditions: ConditionsSource | None = None
    #: What kind of device this is (``phone``, ``sbc``, ``laptop``...), for jobs'
    #: ``[eligibility] device_classes``.
    device_class: str = ""
    #: Builds the device's SecAgg+ party; a seam for tests (``client.secure``).
    secagg_device: DeviceFactory = SecAggDevice


def rebuild_model(base: memoryview, delta: memoryview, task: WorkOrder) -> memoryview:
    """safetensors of ``base + decode(delta)``, checked against the task's model SHA-256."""
    from flotilla.compression import apply_delta, decode_state_with, make_codec
    from flotilla.core.errors import IntegrityError
    from flotilla.core.tensors import decode_state, encode_state

    config = RoundConfig.from_json(task.config_json)
    if config.layout is None:
        raise FlotillaError("a downlink delta came without the model's layout")
    spec = config.compression
    codec = make_codec(spec.downlink, spec.downlink_params)
    change = decode_state_with(delta, config.layout, len(delta), codec=codec)
    whole = encode_state(apply_delta(decode_state(base), change))
    if sha256_hex(whole) != task.model_sha256:
        raise IntegrityError("the rebuilt model does not match the server's")
    return memoryview(whole)
