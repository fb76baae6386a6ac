"""A virtual environment with only the base install (``pip install flotilla``, no extras):
what a light device has. Made once per test session from this checkout, by pip itself, so
the packaging (dependencies, package data, console scripts) is what is tested too.

Measured on the 2-core CI machine with a warm pip cache: about 11 s (venv 3 s, build and
install 8 s). ``--system-site-packages`` would be faster and dishonest: torch would leak in.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

from tests.support.lifetime import bound

ROOT = Path(__file__).resolve().parents[2]
#: pip builds the wheel and fetches numpy, safetensors, cryptography, protobuf.
INSTALL_TIMEOUT_S = 600


@dataclass(frozen=True, slots=True)
class BaseVenv:
    """The environment's interpreter and scripts directory."""

    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def script(self, name: str) -> Path:
        return self.root / "bin" / name

    def env(self) -> dict[str, str]:
        """The environment a command in it runs with: nothing of the test's own Python
        (no PYTHONPATH pointing at this checkout, no shared venv on PATH)."""
        keep = ("HOME", "LANG", "LC_ALL", "TMPDIR", "OMP_NUM_THREADS")
        env = {k: os.environ[k] for k in keep if k in os.environ}
        env["PATH"] = f"{self.root / 'bin'}:/usr/bin:/bin"
        return env

    def run(
        self, argv: list[str], cwd: Path, timeout_s: float = 120, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            bound(argv), cwd=cwd, env=self.env(), capture_output=True, text=True,
            timeout=timeout_s, check=False,
        )  # fmt: skip
        if check and done.returncode != 0:
            raise AssertionError(f"{argv} failed ({done.returncode}):\n{done.stderr[-4000:]}")
        return done


#: Not part of the source: a build from a copy without them cannot pick up stale files
#: (setuptools' ``build/lib`` keeps modules deleted since) nor write into the checkout.
_NOT_SOURCE = (".git", ".venv", "build", "dist", "site", "*.egg-info", "__pycache__",
               ".*_cache", "test-artifacts", "flotilla-state")  # fmt: skip


def make_base_venv(directory: Path) -> BaseVenv:
    """Create ``directory`` as a venv and ``pip install`` this checkout (a clean copy of
    it, beside the venv), without extras."""
    source = directory.with_name(f"{directory.name}-source")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
    venv.EnvBuilder(with_pip=True, clear=True).create(directory)
    made = BaseVenv(directory)
    env = {**made.env(), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    done = subprocess.run(
        bound([str(made.python), "-m", "pip", "install", "--quiet", str(source)]),
        cwd=directory, env=env, capture_output=True, text=True,
        timeout=INSTALL_TIMEOUT_S, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise AssertionError(f"pip install of the base package failed:\n{done.stderr[-4000:]}")
    return made


if __name__ == "__main__":  # make one by hand: python -m tests.support.base_venv DIR
    print(make_base_venv(Path(sys.argv[1])).python)
