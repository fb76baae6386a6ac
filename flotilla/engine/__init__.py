"""The round engine: a job's rounds as select -> dispatch -> collect -> commit.

- ``backend``: the :class:`Backend` protocol (real or virtual devices) and the round's data.
- ``ports``: what the engine needs from storage, evaluation and tasks (:class:`Ledger`,
  :class:`Blobs`, :class:`TaskRuntime`).
- ``plan``: :class:`JobPlan`, a spec turned into aggregator and codecs; :func:`validate_spec`.
- ``services``: :class:`EngineServices`, what every job of a process shares, and
  :class:`EngineConfig`.
- ``tally``: a round's :class:`RoundTally` and reading a result stream.
- ``context``: the public :class:`RoundContext` and the :class:`RoundMode` protocol.
- ``sync_round``, ``buffered``, ``p2p_round``, ``secure_round``: the four modes
  (synchronous, FedBuff's asynchronous buffered rounds, server-less rounds where devices
  average, SecAgg+ rounds where the server sees only the sum).
- ``stages``: :class:`StageExchange`, one secure round's stages between its devices and
  its ``SecAggServer``; :class:`DeviceKeys`, where devices' identity keys are read.
- ``rounds``: :class:`JobRunner`, the context that drives one job in its mode.
- ``build``: :func:`build_runner` and :func:`submitted_job`, shared by server and simulation.
"""

from flotilla.engine.backend import (
    Arrival,
    Backend,
    Delivered,
    Failed,
    Folded,
    FoldSpec,
    Reported,
    ResultStream,
    RoundResult,
    SecureExchange,
    TrainTask,
)
from flotilla.engine.build import build_runner, job_selector, selection_rng, submitted_job
from flotilla.engine.context import Dispatched, RoundContext, RoundMode
from flotilla.engine.plan import JobPlan, validate_spec
from flotilla.engine.ports import Blobs, Evaluator, Ledger, TaskRuntime
from flotilla.engine.rounds import JobRunner, round_mode
from flotilla.engine.secure_round import SecureRounds
from flotilla.engine.services import EngineConfig, EngineServices, P2PPeers
from flotilla.engine.stages import DeviceKeys, StageExchange

__all__ = [
    "Arrival",
    "Backend",
    "Blobs",
    "Delivered",
    "DeviceKeys",
    "Dispatched",
    "EngineConfig",
    "EngineServices",
    "Evaluator",
    "Failed",
    "FoldSpec",
    "Folded",
    "JobPlan",
    "JobRunner",
    "Ledger",
    "P2PPeers",
    "Reported",
    "ResultStream",
    "RoundContext",
    "RoundMode",
    "RoundResult",
    "SecureExchange",
    "SecureRounds",
    "StageExchange",
    "TaskRuntime",
    "TrainTask",
    "build_runner",
    "job_selector",
    "round_mode",
    "selection_rng",
    "submitted_job",
    "validate_spec",
]
