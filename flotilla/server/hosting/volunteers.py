"""Volunteer runs a federation server coordinates (``flotilla server --p2p NAME=TASK``).

Each run's coordinator is a child process (``flotilla volunteer coordinate``, state in
``STATE_DIR/volunteer/NAME``): hivemind forks its own workers and wants the main thread for
signals, neither of which a gRPC server process can offer safely. The child writes
``coordinator.json`` (multiaddrs, public key) once it is up and ``status.json`` every
second; the server reads those for ``Operator.ListVolunteerRuns``, and so never imports
hivemind itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flotilla.core.errors import SpecError
from flotilla.core.timeouts import Timeouts
from flotilla.server.federation.views import VolunteerRunInfo
from flotilla.server.hosting.children import spawn_ready, stop_child


@dataclass(frozen=True, slots=True)
class VolunteerRunSpec:
    run: str
    task: str

    @classmethod
    def parse(cls, text: str) -> VolunteerRunSpec:
        """``NAME=package.module:Task``, as given on the command line."""
        run, sep, task = text.partition("=")
        if not sep or not run.strip() or ":" not in task:
            raise SpecError(f"--p2p wants NAME=package.module:Task, got {text!r}")
        return cls(run.strip(), task.strip())


@dataclass(frozen=True, slots=True)
class HostedRun:
    spec: VolunteerRunSpec
    state_dir: Path
    proc: asyncio.subprocess.Process
    maddrs: tuple[str, ...]
    public_key: str


class VolunteerHost:
    """Starts each volunteer run's coordinator, reports on them, and stops them."""

    def __init__(
        self,
        specs: Sequence[VolunteerRunSpec],
        state_dir: Path,
        host_maddrs: Sequence[str] | None = None,
        timeouts: Timeouts | None = None,
    ) -> None:
        self._specs = list(specs)
        self._timeouts = timeouts or Timeouts()
        self._dir = state_dir
        self._host_maddrs = host_maddrs
        self.runs: list[HostedRun] = []

    async def start(self) -> None:
        for spec in self._specs:
            self.runs.append(await self._start_one(spec))

    async def _start_one(self, spec: VolunteerRunSpec) -> HostedRun:
        state = self._dir / spec.run
        args = [
            "-m", "flotilla", "volunteer", "coordinate", "--run", spec.run,
            "--task", spec.task, "--state-dir", str(state), "--stop-with-parent",
        ]  # fmt: skip
        if self._host_maddrs:
            args += ["--host-maddrs", *self._host_maddrs]
        what = f"volunteer run {spec.run!r}"
        start_s = self._timeouts.child_start_s
        proc, info = await spawn_ready(args, state, "coordinator.json", what, start_s)
        return HostedRun(spec, state, proc, tuple(info["maddrs"]), str(info["public_key"]))

    def infos(self) -> list[VolunteerRunInfo]:
        out = []
        for h in self.runs:
            status = h.state_dir / "status.json"
            out.append(
                VolunteerRunInfo(
                    run=h.spec.run,
                    task=h.spec.task,
                    maddrs=h.maddrs,
                    coordinator_key=h.public_key,
                    status_json=status.read_text() if status.exists() else "",
                )
            )
        return out

    async def stop(self) -> None:
        for hosted in self.runs:
            await stop_child(hosted.proc, self._timeouts.child_stop_s)
