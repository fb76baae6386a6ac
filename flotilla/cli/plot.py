"""``flotilla job plot ID --out DIR``: a job's rounds as PNG charts, from a running server.

The charts are :func:`flotilla.report.write_plots`, the ones ``flotilla simulate`` draws;
here the rounds come over gRPC. Participation is per device: the operator API does not
tell devices' classes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from flotilla.core.errors import FlotillaError

if TYPE_CHECKING:
    from flotilla.cli.remote import RemoteServer
    from flotilla.proto import flotilla_pb2 as pb
    from flotilla.report import JobSeries


async def plot_job(remote: RemoteServer, job_id: str, out_dir: Path) -> list[Path]:
    """Fetch the job's committed rounds and write the charts into ``out_dir``."""
    try:
        import matplotlib  # noqa: F401  (only to say what is missing before any call)
    except ImportError as exc:
        raise FlotillaError(
            "job plot draws with matplotlib: pip install 'flotilla[plots]'"
        ) from exc
    from flotilla.report import write_plots

    info = await remote.job(job_id, with_rounds=True)
    return write_plots([series(info)], out_dir, time_label="time since submitted", groups="device")


def series(info: pb.JobInfo) -> JobSeries:
    """The job's rounds as the charts take them (time from the job's submission)."""
    from flotilla.report import JobSeries, RoundPoint

    points = tuple(
        RoundPoint(
            round=r.round,
            seconds=r.committed_at - info.created_at,
            metrics=dict(r.metrics),
            bytes_up=r.bytes_up,
            bytes_down=r.bytes_down,
            participants=tuple(r.participants),
        )
        for r in info.rounds
    )
    return JobSeries(info.name or info.id, points)
