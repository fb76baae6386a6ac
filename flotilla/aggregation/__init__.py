"""Aggregation: turning accepted updates into the next global model.

- ``fedavg``: :class:`StreamingFedAvg`, a sample-weighted mean folded in as updates arrive.
"""

from flotilla.aggregation.fedavg import StreamingFedAvg

__all__ = ["StreamingFedAvg"]
