"""Job files: one job spec, or several jobs as ``[[jobs]]`` overrides of one base spec.

```toml
[job]            # ... any job spec section (docs/jobs.md)
[[jobs]]         # optional: each entry overrides the spec above for one more job
job = { name = "a", seed = 1 }
[population]     # read by the simulator only; a real submission passes over it
[simulation]
```

``flotilla job submit`` and ``flotilla simulate`` read files through here, so an experiment
designed in simulation is submitted unchanged to a real server, and submitting needs no
simulator. A rule that belongs to one reader stays with that reader: the simulator refuses
``aggregation.transport = "p2p"`` (flotilla.simulation.experiment); a server runs it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flotilla.core.errors import SpecError
from flotilla.core.spec import JobSpec, apply_override, parse_toml, read_toml

#: Top-level tables of an experiment file that describe the simulated fleet, not a job.
SIMULATOR_TABLES = ("population", "simulation")
#: Keys of a ``[[jobs]]`` entry that only the simulator reads (a job's start on the
#: virtual clock); a real submission passes over them.
SIMULATOR_JOB_KEYS = ("start_s",)


def load_job_specs(path: str | Path, overrides: Sequence[str] = ()) -> tuple[JobSpec, ...]:
    """The jobs a file describes: its one job, or one per ``[[jobs]]`` entry.

    ``overrides`` are ``section.field=value``; they apply to the base spec before the
    entries do, so an entry's own value wins.
    """
    raw = read_toml(Path(path))
    for item in overrides:
        apply_override(raw, item, str(path))
    return job_specs_from_dict(raw, str(path))


def job_specs_from_text(text: str, source: str, job: str | None = None) -> tuple[JobSpec, ...]:
    """The jobs of a job file's text (an HTTP request's body), read as :func:`load_job_specs`
    reads a file; with ``job``, only the job of that name (``job submit --job NAME``)."""
    specs = job_specs_from_dict(parse_toml(text, source), source)
    if job is None:
        return specs
    picked = tuple(s for s in specs if s.job.name == job)
    if not picked:
        names = ", ".join(s.job.name for s in specs)
        raise SpecError(f"{source}: no job named {job!r} (its jobs: {names})")
    return picked


def job_specs_from_dict(raw: Mapping[str, Any], source: str) -> tuple[JobSpec, ...]:
    """Every job of a parsed file; names must differ, so ``--job NAME`` picks one. The
    simulator's tables are left to the simulator."""
    data = {key: value for key, value in raw.items() if key not in SIMULATOR_TABLES}
    variants = data.pop("jobs", [])
    if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants):
        raise SpecError(f"{source}: 'jobs' must be an array of tables ([[jobs]])")
    if not variants:
        specs = [JobSpec.from_dict(data, source)]
    else:
        specs = [
            JobSpec.from_dict(_merged(data, _job_keys(v)), f"{source} [[jobs]] #{i + 1}")
            for i, v in enumerate(variants)
        ]
    names = [s.job.name for s in specs]
    if len(set(names)) != len(names):
        raise SpecError(f"{source}: job names must differ, got {names}")
    return tuple(specs)


def _job_keys(entry: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in entry.items() if key not in SIMULATOR_JOB_KEYS}


def _merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
