"""Experiment files: a job spec plus a ``[population]``, optionally several jobs.

```toml
[job]            # ... any job spec section, as for `flotilla job submit`
[population]     # the virtual fleet (flotilla.simulation.population)
[simulation]     # seed, time limit, trainer choice
[[jobs]]         # optional: each entry overrides the spec above for one more job
job = { name = "a", seed = 1 }
```

Without ``[[jobs]]`` the experiment runs the one job its spec describes. Every field is
checked like a job spec's: an unknown one is an error naming it and the file.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from flotilla.core.errors import SpecError
from flotilla.core.spec import JobSpec, apply_override, build_dataclass
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

    def __post_init__(self) -> None:
        if self.trainer not in ("auto", "batched", "loop"):
            raise SpecError(
                f"simulation.trainer {self.trainer!r} is not one of auto, batched, loop"
            )
        if not self.max_simulated_s > 0:
            raise SpecError("simulation.max_simulated_s must be > 0")


@dataclass(frozen=True, slots=True)
class Experiment:
    jobs: tuple[JobSpec, ...]
    population: PopulationSection = field(default_factory=PopulationSection)
    simulation: SimulationSection = field(default_factory=SimulationSection)

    @property
    def seed(self) -> int:
        return self.simulation.seed

    @property
    def population_seed(self) -> int:
        return self.seed if self.population.seed < 0 else self.population.seed


#: Top-level tables that make a TOML file an experiment rather than a plain job spec.
EXPERIMENT_KEYS = ("population", "simulation", "jobs")


def job_specs(path: str | Path, overrides: Sequence[str] = ()) -> tuple[JobSpec, ...]:
    """The jobs a file describes: its one job, or every job of an experiment file, so the
    experiment designed in simulation is submitted unchanged to a real server."""
    raw = _read(Path(path))
    if any(key in raw for key in EXPERIMENT_KEYS):
        return load_experiment(path, overrides).jobs
    return (JobSpec.load(path, overrides),)


def _read(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise SpecError(f"{path}: no such file") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: not valid TOML: {exc}") from exc
    return data


def load_experiment(
    path: str | Path,
    overrides: Sequence[str] = (),
    clients: int | None = None,
    seed: int | None = None,
) -> Experiment:
    """Read an experiment file; ``overrides`` are ``section.field=value`` as for jobs."""
    path = Path(path)
    raw = _read(path)
    for item in overrides:
        apply_override(raw, item, str(path))
    if clients is not None:
        raw.setdefault("population", {})["clients"] = clients
    if seed is not None:
        raw.setdefault("simulation", {})["seed"] = seed
    return experiment_from_dict(raw, str(path))


def experiment_from_dict(raw: Mapping[str, Any], source: str) -> Experiment:
    data = dict(raw)
    population = build_dataclass(
        PopulationSection, data.pop("population", {}), source, "population."
    )
    simulation = build_dataclass(
        SimulationSection, data.pop("simulation", {}), source, "simulation."
    )
    variants = data.pop("jobs", [])
    if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants):
        raise SpecError(f"{source}: 'jobs' must be an array of tables ([[jobs]])")
    if not variants:
        specs = [JobSpec.from_dict(data, source)]
    else:
        specs = [
            JobSpec.from_dict(_merged(data, v), f"{source} [[jobs]] #{i + 1}")
            for i, v in enumerate(variants)
        ]
    for spec in specs:
        if spec.aggregation.transport != "server":
            raise SpecError(
                f"{source}: job {spec.job.name!r}: simulation runs aggregation.transport = "
                '"server" only (a p2p round averages the same weighted mean on the devices)'
            )
    names = [s.job.name for s in specs]
    if len(set(names)) != len(names):
        raise SpecError(f"{source}: job names must differ, got {names}")
    return Experiment(tuple(specs), population, simulation)


def _merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
