"""Job files as `flotilla job submit` reads them: one job or ``[[jobs]]``, without the simulator."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flotilla.core.errors import SpecError
from flotilla.core.jobfile import load_job_specs
from tests.support.lifetime import bound

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(120)

TWO_JOBS = """
[job]
rounds = 4
clients_per_round = 3

[population]
clients = 50

[[jobs]]
job = { name = "server-side" }

[[jobs]]
job = { name = "on-devices", rounds = 2 }
aggregation = { transport = "p2p" }
compression = { uplink = "int8" }
"""


def _write(tmp_path: Path, text: str, name: str = "jobs.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _loaded_modules(code: str) -> tuple[int, set[str]]:
    """Exit code and the modules a fresh interpreter holds after running ``code``."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run(
        bound([sys.executable, "-c", script]),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    return proc.returncode, set(json.loads(proc.stdout.splitlines()[-1]))


def _ours_beyond_core(modules: set[str]) -> list[str]:
    heavy = ("torch", "grpc", "sqlalchemy", "hivemind")
    return sorted(
        m
        for m in modules
        if (m.startswith("flotilla.") and not m.startswith("flotilla.core"))
        or m.split(".")[0] in heavy
    )


def test_a_multi_job_file_with_a_p2p_job_loads_for_a_real_server(tmp_path: Path) -> None:
    specs = load_job_specs(_write(tmp_path, TWO_JOBS))
    assert [s.job.name for s in specs] == ["server-side", "on-devices"]
    assert [s.aggregation.transport for s in specs] == ["server", "p2p"]
    assert [s.job.rounds for s in specs] == [4, 2]
    assert {s.job.clients_per_round for s in specs} == {3}, "the base spec reaches every job"


def test_the_simulator_still_refuses_a_p2p_job_naming_it(tmp_path: Path) -> None:
    from flotilla.simulation import load_experiment

    with pytest.raises(SpecError, match=r"job 'on-devices': simulation runs .*\"server\" only"):
        load_experiment(_write(tmp_path, TWO_JOBS))


def test_overrides_reach_every_job_unless_an_entry_sets_the_field(tmp_path: Path) -> None:
    path = _write(tmp_path, TWO_JOBS)
    specs = load_job_specs(path, ["job.rounds=7", "train.batch_size=8"])
    assert [s.job.rounds for s in specs] == [7, 2]
    assert [s.train.batch_size for s in specs] == [8, 8]


def test_a_plain_spec_is_one_job_and_the_examples_load() -> None:
    assert [s.job.name for s in load_job_specs(ROOT / "examples" / "digits.toml")] == ["digits"]
    for path in sorted((ROOT / "examples").glob("*.toml")):
        assert load_job_specs(path), path


def test_job_file_mistakes_are_errors_naming_the_file_and_entry(tmp_path: Path) -> None:
    twins = _write(tmp_path, "[[jobs]]\n[[jobs]]\n", "twins.toml")
    with pytest.raises(SpecError, match=r"twins\.toml: job names must differ"):
        load_job_specs(twins)
    bad_entry = _write(tmp_path, "[[jobs]]\njob = { name = 'a' }\n[[jobs]]\njob = { rund = 2 }\n")
    with pytest.raises(SpecError, match=r"\[\[jobs\]\] #2: unknown field 'job.rund'"):
        load_job_specs(bad_entry)
    not_tables = _write(tmp_path, "jobs = 3\n", "scalar.toml")
    with pytest.raises(SpecError, match="must be an array of tables"):
        load_job_specs(not_tables)
    typo = _write(tmp_path, "[populaton]\nclients = 5\n", "typo.toml")
    with pytest.raises(SpecError, match="unknown field 'populaton'"):
        load_job_specs(typo)
    with pytest.raises(SpecError, match="no such file"):
        load_job_specs(tmp_path / "missing.toml")


def test_reading_a_job_file_loads_only_core(tmp_path: Path) -> None:
    path = _write(tmp_path, TWO_JOBS)
    code = f"from flotilla.core.jobfile import load_job_specs\nload_job_specs({str(path)!r})"
    rc, modules = _loaded_modules(code)
    assert rc == 0
    assert "flotilla.core.jobfile" in modules
    assert _ours_beyond_core(modules) == []


def test_job_submit_reads_the_file_without_the_simulator(tmp_path: Path) -> None:
    """The CLI path itself: the file is read (an unknown --job is refused) before connecting."""
    path = _write(tmp_path, TWO_JOBS)
    argv = ["job", "submit", str(path), "--job", "absent"]
    code = f"from flotilla.cli import main\nassert main({argv!r}) != 0"
    rc, modules = _loaded_modules(code)
    assert rc == 0
    assert not any(m.startswith(("flotilla.simulation", "flotilla.engine")) for m in modules)
