"""PNG charts of jobs' rounds, drawn the same for a federation (``flotilla job plot``) and a
simulation (``flotilla simulate`` writes them into its output directory).

Each source turns its rounds into :class:`RoundPoint` values; nothing here knows where they
came from. matplotlib (the ``plots`` extra) is imported when a chart is drawn, with the Agg
backend, so no display is needed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Every file :func:`write_plots` writes, whatever the rounds hold.
PLOT_FILES = (
    "accuracy_vs_round.png",
    "accuracy_vs_time.png",
    "loss_vs_round.png",
    "loss_vs_time.png",
    "bytes_per_round.png",
    "participation.png",
)
#: Groups drawn by name in the participation chart; the rest are summed as "other".
MAX_GROUPS = 8


@dataclass(frozen=True, slots=True)
class RoundPoint:
    """One committed round, as the charts need it."""

    round: int
    #: Seconds since the job started: wall time on a server, simulated time in a simulation.
    seconds: float
    metrics: Mapping[str, float] = field(default_factory=dict)
    #: Update bytes the server took in, and model bytes the contributors downloaded.
    bytes_up: int = 0
    bytes_down: int = 0
    #: One entry per device that delivered: its device class, or its id where the class
    #: is not known.
    participants: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class JobSeries:
    name: str
    points: tuple[RoundPoint, ...]


def write_plots(
    jobs: Sequence[JobSeries], out_dir: Path, time_label: str = "time", groups: str = "device class"
) -> list[Path]:
    """Write :data:`PLOT_FILES` into ``out_dir`` (one line or panel per job); their paths.

    ``time_label`` names the time axis ("simulated time"); ``groups`` what participants are
    grouped by ("device class", or "device" where classes are unknown)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    unit, per = _time_unit(max((p.seconds for j in jobs for p in j.points), default=0.0))
    drawings: dict[str, Callable[[Any], None]] = {}
    for metric in ("accuracy", "loss"):
        drawings[f"{metric}_vs_round.png"] = _metric(jobs, metric, "round", lambda p: p.round)
        drawings[f"{metric}_vs_time.png"] = _metric(
            jobs, metric, f"{time_label} ({unit})", lambda p: p.seconds / per
        )
    drawings["bytes_per_round.png"] = _bytes(jobs)
    written = []
    for name in PLOT_FILES:
        if name == "participation.png":
            fig = _participation(plt, jobs, groups)
        else:
            fig, ax = plt.subplots(figsize=(6, 4))
            drawings[name](ax)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        written.append(out_dir / name)
    return written


def _time_unit(end_s: float) -> tuple[str, float]:
    return ("s", 1.0) if end_s < 120 else ("min", 60.0) if end_s < 7200 else ("h", 3600.0)


def _metric(
    jobs: Sequence[JobSeries], metric: str, x_label: str, x: Callable[[RoundPoint], float]
) -> Callable[[Any], None]:
    def draw(ax: Any) -> None:
        for job in jobs:
            points = [(x(p), p.metrics[metric]) for p in job.points if metric in p.metrics]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker=".", label=job.name)
        ax.set_xlabel(x_label)
        if x_label == "round":
            _whole_rounds(ax)
        ax.set_ylabel("held-out " + metric)
        _legend_or_note(ax, f"no round reported {metric}")

    return draw


def _bytes(jobs: Sequence[JobSeries]) -> Callable[[Any], None]:
    def draw(ax: Any) -> None:
        for job in jobs:
            rounds = [p.round for p in job.points]
            line = ax.plot(rounds, [p.bytes_up / 1e6 for p in job.points], marker=".")
            ax.plot(
                rounds,
                [p.bytes_down / 1e6 for p in job.points],
                marker=".",
                linestyle="--",
                color=line[0].get_color(),
            )
            line[0].set_label(f"{job.name} up (solid) / down (dashed)")
        ax.set_xlabel("round")
        _whole_rounds(ax)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("MB per round")
        _legend_or_note(ax, "no rounds")

    return draw


def _participation(plt: Any, jobs: Sequence[JobSeries], groups: str) -> Any:
    """Stacked bars per round: how many participants of each group delivered."""
    panels = max(1, len(jobs))
    fig, axes = plt.subplots(panels, 1, figsize=(6, 2.5 + 1.5 * panels), squeeze=False)
    for ax, job in zip(axes[:, 0], jobs or [JobSeries("", ())], strict=True):
        counts = [Counter(p.participants) for p in job.points]
        named = _top_groups(counts)
        rounds = [p.round for p in job.points]
        bottom = [0] * len(rounds)
        for group in [*named, "other"]:
            heights = [
                sum(v for k, v in c.items() if k not in named) if group == "other" else c[group]
                for c in counts
            ]
            if any(heights):
                ax.bar(rounds, heights, bottom=bottom, label=group)
                bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.set_title(f"{job.name}: participants per {groups}" if job.name else "participants")
        ax.set_xlabel("round")
        _whole_rounds(ax)
        ax.set_ylabel("devices")
        _legend_or_note(ax, "no rounds")
    return fig


def _top_groups(counts: Sequence[Counter[str]]) -> list[str]:
    total: Counter[str] = Counter()
    for c in counts:
        total.update(c)
    return sorted(g for g, _ in total.most_common(MAX_GROUPS))


def _whole_rounds(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _legend_or_note(ax: Any, note: str) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes)
