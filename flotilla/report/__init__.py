"""What a run shows the people watching it, the same for a federation and a simulation.

- ``progress``: :class:`JobBars`, one console progress bar per job (or a short line per
  round where the console is no terminal).
- ``plots``: :func:`write_plots`, PNG charts of a job's rounds (``flotilla job plot`` and
  ``flotilla simulate``); matplotlib is imported only when plots are drawn.

Imports only :mod:`flotilla.core`: the CLI, the server and the simulator all use it.
"""

from flotilla.report.plots import PLOT_FILES, JobSeries, RoundPoint, write_plots
from flotilla.report.progress import JobBars

__all__ = ["PLOT_FILES", "JobBars", "JobSeries", "RoundPoint", "write_plots"]
