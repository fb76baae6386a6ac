"""Peer-to-peer training on hivemind: volunteer runs and server-less federated rounds.

- :mod:`flotilla.p2p.record` -- :class:`RunRecord`, signed by the coordinator (Ed25519).
- :mod:`flotilla.p2p.dht` -- the run's DHT keys; records, peer metrics, run status.
- :mod:`flotilla.p2p.codecs` -- flotilla's int8 as a hivemind ``CompressionBase``.
- :mod:`flotilla.p2p.swarm` -- the ``hivemind.Optimizer`` a record describes; checkpoints.
- :mod:`flotilla.p2p.volunteer` -- join a run and train.
- :mod:`flotilla.p2p.coordinator` -- bootstrap, publish, checkpoint and monitor a run.
- :mod:`flotilla.p2p.averaging` -- whole-or-nothing all-reduce; members that agree bitwise.
- :mod:`flotilla.p2p.federated` -- a device's all-reduce in a server-less federated round.
- :mod:`flotilla.p2p.rendezvous` -- the server's rendezvous peer for those rounds.

Needs the ``p2p`` extra (hivemind). See docs/p2p.md.
"""

from flotilla.core.errors import RunRecordError
from flotilla.p2p.codecs import (
    COMPRESSION_NAMES,
    FlotillaInt8,
    hivemind_compression,
    install_codecs,
)
from flotilla.p2p.coordinator import Coordinator, CoordinatorOptions
from flotilla.p2p.dht import (
    PeerMetrics,
    RunStatus,
    fetch_record,
    read_metrics,
    read_status,
    start_dht,
)
from flotilla.p2p.federated import AgreedAverage, UpdateAverager, agreed_model
from flotilla.p2p.record import RunRecord, SignedRecord, sign_record, verify_record
from flotilla.p2p.volunteer import VolunteerOptions, VolunteerReport, run_volunteer

__all__ = [
    "COMPRESSION_NAMES",
    "AgreedAverage",
    "Coordinator",
    "CoordinatorOptions",
    "FlotillaInt8",
    "PeerMetrics",
    "RunRecord",
    "RunRecordError",
    "RunStatus",
    "SignedRecord",
    "UpdateAverager",
    "VolunteerOptions",
    "VolunteerReport",
    "agreed_model",
    "fetch_record",
    "hivemind_compression",
    "install_codecs",
    "read_metrics",
    "read_status",
    "run_volunteer",
    "sign_record",
    "start_dht",
    "verify_record",
]
