"""``flotilla job status ID --watch``: a job's state, round and latest metrics, redrawn in
place until the job ends, so an operator need not poll by hand.

On a terminal the table is redrawn every interval (the elapsed time moves); elsewhere (a
pipe, a CI log) it is printed again only when something changed, and ``--json`` prints one
JSON line per change. The exit status says how the job ended: 0 completed, 1 failed or
cancelled (130 on Ctrl-C, from the CLI's entry point).
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from flotilla.cli.remote import RemoteServer

#: The exit status for each state a job ends in.
END_STATUS = {"completed": 0, "failed": 1, "cancelled": 1}
#: Metrics the table shows, where the job reports them.
SHOWN = ("accuracy", "loss")


async def watch(
    remote: RemoteServer, job_id: str, interval_s: float, as_json: bool, out: TextIO | None = None
) -> int:
    """Poll the job every ``interval_s`` (each call under the remote's deadline) until it
    ends; the exit status for how it ended."""
    import asyncio

    from flotilla.cli.remote import job_json

    stream = out if out is not None else sys.stdout
    live = not as_json and stream.isatty()
    last: tuple[Any, ...] | None = None
    drawn = 0
    while True:
        info = job_json(await remote.job(job_id))
        seen = (info["state"], info["rounds_committed"], sorted(info["metrics"].items()))
        if as_json and seen != last:
            stream.write(json.dumps(info, sort_keys=True) + "\n")
        elif live:
            lines = table(info, time.time())
            # Back to the table's first line, erase to the end, draw it again.
            stream.write((f"\x1b[{drawn}F\x1b[J" if drawn else "") + "\n".join(lines) + "\n")
            drawn = len(lines)
        elif not as_json and seen != last:
            stream.write("\n".join(table(info, time.time())) + "\n")
        stream.flush()
        last = seen
        if info["state"] in END_STATUS:
            return END_STATUS[info["state"]]
        await asyncio.sleep(interval_s)


def table(info: dict[str, Any], now: float) -> list[str]:
    """The watch table: a header and the job's row."""
    metrics = info["metrics"]
    cells = [f"{metrics[k]:.4f}" if k in metrics else "-" for k in SHOWN]
    rounds = f"{info['rounds_committed']}/{info['rounds_total']}"
    ended = info["state"] in END_STATUS and info.get("updated_at")
    elapsed = (info["updated_at"] if ended else now) - info["created_at"]
    header = f"{'JOB':16} {'NAME':16} {'STATE':10} {'ROUND':>9} "
    header += " ".join(f"{k.upper():>9}" for k in SHOWN) + f" {'ELAPSED':>9}"
    row = f"{info['id']:16} {info['name'][:16]:16} {info['state']:10} {rounds:>9} "
    row += " ".join(f"{c:>9}" for c in cells) + f" {duration(elapsed):>9}"
    return [header, row]


def duration(seconds: float) -> str:
    """12s, 3m05s, 2h07m: how long a job has run."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
