"""Simulation: thousands of virtual clients on the real engine, in simulated time.

- ``clock``: :class:`VirtualClockLoop`, asyncio in simulated seconds; :func:`run_simulated`.
- ``population``: device classes, CSV traces and availability (:class:`PopulationSection`).
- ``fleet``: :class:`Fleet`, the virtual devices coming and going on the engine's pool.
- ``training``: batched (``vmap``) and per-client local training of many clients.
- ``backend``: :class:`SimBackend`, the engine's Backend over the virtual fleet.
- ``experiment``: experiment files (a job spec, ``[population]``, ``[[jobs]]``).
- ``runner``: :func:`run_experiment`, behind ``flotilla simulate``.
"""

from flotilla.core.errors import SimulationStalled
from flotilla.simulation.backend import SimBackend
from flotilla.simulation.clock import VirtualClockLoop, run_simulated
from flotilla.simulation.experiment import (
    Experiment,
    SimulationSection,
    experiment_from_dict,
    load_experiment,
)
from flotilla.simulation.fleet import Fleet
from flotilla.simulation.population import (
    AvailabilitySection,
    DeviceClass,
    PopulationSection,
    VirtualDevice,
    draw_devices,
    sessions,
)
from flotilla.simulation.runner import run_experiment
from flotilla.simulation.training import (
    BatchedTrainer,
    ClientResult,
    ClientTrainer,
    LoopTrainer,
    ShardCache,
    is_batchable,
    make_trainer,
)
from flotilla.simulation.uplink import SimulatedUplink

__all__ = [
    "AvailabilitySection",
    "BatchedTrainer",
    "ClientResult",
    "ClientTrainer",
    "DeviceClass",
    "Experiment",
    "Fleet",
    "LoopTrainer",
    "PopulationSection",
    "ShardCache",
    "SimBackend",
    "SimulatedUplink",
    "SimulationSection",
    "SimulationStalled",
    "VirtualClockLoop",
    "VirtualDevice",
    "draw_devices",
    "experiment_from_dict",
    "is_batchable",
    "load_experiment",
    "make_trainer",
    "run_experiment",
    "run_simulated",
    "sessions",
]
