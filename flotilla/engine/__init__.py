"""The round engine: a job's rounds as select -> dispatch -> collect -> commit.

- ``backend``: the :class:`Backend` protocol (real or virtual devices) and the round's data.
- ``ports``: what the engine needs from storage and evaluation (:class:`Ledger`, :class:`Blobs`).
- ``plan``: :class:`JobPlan`, a spec turned into aggregator and codecs; :func:`validate_spec`.
- ``rounds``: :class:`JobRunner`, which drives one job round by round.
- ``p2p_round``: server-less rounds (``transport = "p2p"``): devices average, quorum commits.
- ``buffered``: FedBuff's asynchronous rounds, for strategies with ``traits.asynchronous``.
- ``evaluation``: a job's round-0 model and held-out evaluation, from its task.
"""

from flotilla.engine.backend import Backend, Delivered, Failed, Reported, RoundResult, TrainTask
from flotilla.engine.evaluation import initial_model, server_evaluator
from flotilla.engine.plan import JobPlan, validate_spec
from flotilla.engine.ports import Blobs, Evaluator, Ledger
from flotilla.engine.rounds import EngineConfig, JobRunner

__all__ = [
    "Backend",
    "Blobs",
    "Delivered",
    "EngineConfig",
    "Evaluator",
    "Failed",
    "JobPlan",
    "JobRunner",
    "Ledger",
    "Reported",
    "RoundResult",
    "TrainTask",
    "initial_model",
    "server_evaluator",
    "validate_spec",
]
