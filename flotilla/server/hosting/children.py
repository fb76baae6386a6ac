"""Child processes the server runs hivemind in (volunteer coordinators, the rendezvous).

hivemind forks its own workers and wants the main thread for signals, neither of which a
gRPC server process can offer safely; so each hivemind peer is a child in its own session
that writes a JSON file when it is up. The server reads files and never imports hivemind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from flotilla.core.errors import FlotillaError


async def spawn_ready(
    args: list[str], state_dir: Path, ready_name: str, what: str, start_s: float
) -> tuple[asyncio.subprocess.Process, dict[str, Any]]:
    """Start ``python ARGS`` and wait up to ``start_s`` for it to write
    ``state_dir/ready_name``; its stderr goes to ``state_dir/<ready stem>.log``. Returns the
    process and the file's JSON."""
    state_dir.mkdir(parents=True, exist_ok=True)
    ready = state_dir / ready_name
    ready.unlink(missing_ok=True)
    log_path = state_dir / f"{ready.stem}.log"
    log = open(log_path, "ab")  # noqa: SIM115 (the child owns it)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *args,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=log,
        start_new_session=True,
    )
    log.close()
    deadline = time.monotonic() + start_s
    while not ready.exists():
        if proc.returncode is not None or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            tail = log_path.read_text(errors="replace")[-2000:]
            raise FlotillaError(f"{what} did not start:\n{tail}")
        await asyncio.sleep(0.2)
    return proc, json.loads(ready.read_text())


async def stop_child(proc: asyncio.subprocess.Process, stop_s: float) -> None:
    """SIGTERM the child's session, SIGKILL it after ``stop_s``."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), stop_s)
    except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
