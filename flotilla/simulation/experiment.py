"""Experiment files: a job file (flotilla.core.jobfile) plus the simulated fleet.

```toml
[job]            # ... any job spec section, as for `flotilla job submit`
[population]     # the virtual fleet (flotilla.simulation.population)
[simulation]     # seed, time limit, trainer choice
[[jobs]]         # optional: each entry overrides the spec above for one more job
job = { name = "a", seed = 1 }
start_s = 600.0  # optional: the job starts this many simulated seconds in (default 0)
```

Without ``[[jobs]]`` the experiment runs the one job its spec describes. Every field is
checked like a job spec's: an unknown one is an error naming it and the file. The jobs are
read by core, as ``flotilla job submit`` reads them; what only simulation requires (every
job aggregates on the server) is checked here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flotilla.core.errors import SpecError
from flotilla.core.jobfile import job_specs_from_dict
from flotilla.core.spec import JobSpec, apply_override, read_toml
from flotilla.core.tables import build_dataclass
from flotilla.simulation.population import PopulationSection


@dataclass(frozen=True, slots=True)
class SimulationSection:
    """How the simulator runs (``[simulation]``)."""

    #: Seed of selection, population and dropouts; ``--seed`` overrides it.
    seed: int = 0
    #: Simulated seconds after which unfinished jobs are stopped.
    max_simulated_s: float = 30 * 86_400.0
    #: ``auto``: vectorized when the task allows it; ``batched`` or ``loop`` to insist.
    trainer: str = "auto"
    #: How jobs deciding at the same moment share devices: ``joint`` (one assignment of
    #: the contested devices) or ``sequential`` (oldest first), as on a server.
    arbiter: str = "joint"

    def __post_init__(self) -> None:
        if self.trainer not in ("auto", "batched", "loop"):
            raise SpecError(
                f"simulation.trainer {self.trainer!r} is not one of auto, batched, loop"
            )
        if self.arbiter not in ("joint", "sequential"):
            raise SpecError(f"simulation.arbiter {self.arbiter!r} is not one of joint, sequential")
        if not self.max_simulated_s > 0:
            raise SpecError("simulation.max_simulated_s must be > 0")


@dataclass(frozen=True, slots=True)
class Experiment:
    jobs: tuple[JobSpec, ...]
    population: PopulationSection = field(default_factory=PopulationSection)
    simulation: SimulationSection = field(default_factory=SimulationSection)
    #: Per job (as ``jobs``): when it starts on the virtual clock, from a ``[[jobs]]``
    #: entry's ``start_s``, so arrivals over time can be studied; empty: all at 0.
    starts: tuple[float, ...] = ()
    #: Where its tasks' modules are looked for first: the experiment file's own directory,
    #: so a task written beside the file needs no package or ``PYTHONPATH``.
    task_dirs: tuple[Path, ...] = ()

    def start_s(self, index: int) -> float:
        """When job ``index`` starts, in simulated seconds."""
        return self.starts[index] if index < len(self.starts) else 0.0

    @property
    def seed(self) -> int:
        return self.simulation.seed

    @property
    def population_seed(self) -> int:
        return self.seed if self.population.seed < 0 else self.population.seed


def load_experiment(
    path: str | Path,
    overrides: Sequence[str] = (),
    clients: int | None = None,
    seed: int | None = None,
) -> Experiment:
    """Read an experiment file; ``overrides`` are ``section.field=value`` as for jobs."""
    path = Path(path)
    raw = read_toml(path)
    for item in overrides:
        apply_override(raw, item, str(path))
    if clients is not None:
        raw.setdefault("population", {})["clients"] = clients
    if seed is not None:
        raw.setdefault("simulation", {})["seed"] = seed
    experiment = experiment_from_dict(raw, str(path))
    return dataclasses.replace(experiment, task_dirs=(path.resolve().parent,))


def experiment_from_dict(raw: Mapping[str, Any], source: str) -> Experiment:
    population = build_dataclass(
        PopulationSection, raw.get("population", {}), source, "population."
    )
    simulation = build_dataclass(
        SimulationSection, raw.get("simulation", {}), source, "simulation."
    )
    jobs = job_specs_from_dict(raw, source)
    for spec in jobs:
        if population.clients < spec.job.clients_per_round:
            raise SpecError(
                f"{source}: job {spec.job.name!r}: population.clients ({population.clients}, "
                f"--clients) is below job.clients_per_round ({spec.job.clients_per_round}): "
                "its rounds would wait for devices that do not exist; raise the population "
                "or lower job.clients_per_round (and job.min_quorum)"
            )
        if spec.aggregation.transport != "server":
            raise SpecError(
                f"{source}: job {spec.job.name!r}: simulation runs aggregation.transport = "
                '"server" only (a p2p round averages the same weighted mean on the devices)'
            )
    return Experiment(jobs, population, simulation, _starts(raw, source))


def _starts(raw: Mapping[str, Any], source: str) -> tuple[float, ...]:
    """Each ``[[jobs]]`` entry's ``start_s`` (0 when absent)."""
    entries = raw.get("jobs", [])
    starts = []
    for i, entry in enumerate(entries if isinstance(entries, list) else []):
        value = entry.get("start_s", 0.0) if isinstance(entry, Mapping) else 0.0
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise SpecError(f"{source} [[jobs]] #{i + 1}: start_s must be a number >= 0")
        starts.append(float(value))
    return tuple(starts) if any(starts) else ()
