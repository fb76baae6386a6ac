"""The round engine: a job's rounds as select -> dispatch -> collect -> commit.

- ``backend``: the :class:`Backend` protocol (real or virtual devices) and the round's data.
- ``ports``: what the engine needs from storage and evaluation (:class:`Ledger`, :class:`Blobs`).
- ``rounds``: :class:`JobRunner`, which drives one job round by round.
"""

from flotilla.engine.backend import Backend, Delivered, Failed, RoundResult, TrainTask
from flotilla.engine.ports import Blobs, Evaluator, Ledger
from flotilla.engine.rounds import EngineConfig, JobRunner

__all__ = [
    "Backend",
    "Blobs",
    "Delivered",
    "EngineConfig",
    "Evaluator",
    "Failed",
    "JobRunner",
    "Ledger",
    "RoundResult",
    "TrainTask",
]
