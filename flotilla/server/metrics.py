"""Prometheus metrics for a federation server, fed by its event stream.

:class:`PrometheusMetrics` is an :class:`~flotilla.core.events.EventSink`: the server's
``Fanout`` hands it every event, and it moves counters and histograms on its *own*
``CollectorRegistry`` (never the process-global one, so two servers in one process, as
tests run them, keep separate numbers). Devices by state are read from the federation at
scrape time by a custom collector, so that gauge is never stale. The HTTP edge serves
:meth:`PrometheusMetrics.exposition` at ``/metrics``. Every metric is described in
``docs/metrics.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from flotilla.core.events import (
    BytesSent,
    DeviceFailed,
    Event,
    JobChanged,
    PollAnswered,
    RoundCommitted,
    RoundRetried,
    StoreCommitted,
    UpdateAccepted,
    UpdateRefused,
)

#: Device states the ``flotilla_devices`` gauge always reports (0 when none).
DEVICE_STATES: tuple[str, ...] = ("idle", "busy", "offline")

#: Seconds from selection to commit: rounds take from a second to an hour.
ROUND_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
#: Seconds to combine a round's updates: milliseconds (FedAvg) to seconds (robust rules).
AGGREGATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Seconds a device's long poll was held: instant with work waiting, up to the hold.
POLL_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
#: Seconds one round's database transaction took.
DB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

DeviceStates = Callable[[], Mapping[str, int]]


class _DeviceGauge(Collector):
    """``flotilla_devices{state}``, read from the federation at each scrape."""

    def __init__(self) -> None:
        self.source: DeviceStates | None = None

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            "flotilla_devices", "Enrolled devices by state, at scrape time.", labels=["state"]
        )
        counts = self.source() if self.source is not None else {}
        for state in sorted({*DEVICE_STATES, *counts}):
            gauge.add_metric([state], float(counts.get(state, 0)))
        yield gauge

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("flotilla_devices", "Enrolled devices by state, at scrape time.")


class _LoopGauge(Collector):
    """``flotilla_event_loop_tasks``: asyncio tasks alive on the serving loop at scrape time
    (flat under steady load; growth is a leak). No sample when scraped off the loop."""

    NAME = "flotilla_event_loop_tasks"
    HELP = "asyncio tasks alive on the server's event loop, at scrape time."

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(self.NAME, self.HELP)
        with contextlib.suppress(RuntimeError):  # scraped off the loop: no sample
            gauge.add_metric([], len(asyncio.all_tasks(asyncio.get_running_loop())))
        yield gauge

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.NAME, self.HELP)


class PrometheusMetrics:
    """Counters and histograms of one server, on a registry of their own."""

    def __init__(self, device_states: DeviceStates | None = None) -> None:
        """``device_states``: enrolled devices by state, called at each scrape (set it
        later with :meth:`watch_devices` when the federation is built after this)."""
        self.registry = registry = CollectorRegistry()
        self._rounds = Counter(
            "flotilla_rounds_committed", "Rounds committed.", ["job"], registry=registry
        )
        self._retries = Counter(
            "flotilla_rounds_retried",
            "Round attempts that ended without a commit, by why.",
            ["job", "reason"],
            registry=registry,
        )
        self._accepted = Counter(
            "flotilla_updates_accepted", "Device updates taken.", ["job"], registry=registry
        )
        self._refused = Counter(
            "flotilla_updates_refused",
            "Device updates refused, by why.",
            ["job", "reason"],
            registry=registry,
        )
        self._failures = Counter(
            "flotilla_device_failures",
            "Selected devices that delivered nothing usable to a round, by why.",
            ["job", "reason"],
            registry=registry,
        )
        self._jobs = Counter(
            "flotilla_job_transitions",
            "Jobs entering a state (pending, running, completed, failed, cancelled).",
            ["state"],
            registry=registry,
        )
        self._received = Counter(
            "flotilla_bytes_received", "Update bytes taken from devices.", registry=registry
        )
        self._sent = Counter(
            "flotilla_bytes_sent",
            "Model bytes streamed to devices and operators.",
            registry=registry,
        )
        self._round_s = Histogram(
            "flotilla_round_duration_seconds",
            "Seconds from a round's selection to its commit.",
            buckets=ROUND_BUCKETS,
            registry=registry,
        )
        self._aggregation_s = Histogram(
            "flotilla_aggregation_seconds",
            "Seconds spent combining a committed round's updates.",
            buckets=AGGREGATION_BUCKETS,
            registry=registry,
        )
        self._poll_s = Histogram(
            "flotilla_poll_latency_seconds",
            "Seconds a device's poll took to answer (work or none).",
            buckets=POLL_BUCKETS,
            registry=registry,
        )
        self._db_s = Histogram(
            "flotilla_db_commit_seconds",
            "Seconds of the database transaction that commits a round.",
            buckets=DB_BUCKETS,
            registry=registry,
        )
        self._devices = _DeviceGauge()
        self._devices.source = device_states
        registry.register(self._devices)
        registry.register(_LoopGauge())
        # process_resident_memory_bytes, process_open_fds, process_cpu_seconds_total...
        ProcessCollector(registry=registry)

    def watch_devices(self, device_states: DeviceStates) -> None:
        self._devices.source = device_states

    def emit(self, event: Event) -> None:
        if isinstance(event, RoundCommitted):
            self._rounds.labels(event.job_id).inc()
            self._round_s.observe(max(event.duration_s, 0.0))
            self._aggregation_s.observe(max(event.aggregation_s, 0.0))
        elif isinstance(event, RoundRetried):
            self._retries.labels(event.job_id, event.reason).inc()
        elif isinstance(event, UpdateAccepted):
            self._accepted.labels(event.job_id).inc()
            self._received.inc(max(event.size_bytes, 0))
        elif isinstance(event, UpdateRefused):
            self._refused.labels(event.job_id, event.reason).inc()
        elif isinstance(event, DeviceFailed):
            self._failures.labels(event.job_id, event.reason).inc()
        elif isinstance(event, BytesSent):
            self._sent.inc(max(event.size_bytes, 0))
        elif isinstance(event, JobChanged):
            self._jobs.labels(event.state).inc()
        elif isinstance(event, PollAnswered):
            self._poll_s.observe(max(event.latency_s, 0.0))
        elif isinstance(event, StoreCommitted):
            self._db_s.observe(max(event.latency_s, 0.0))

    def exposition(self) -> tuple[bytes, str]:
        """The registry in the Prometheus text format, and its content type: the body and
        header of a ``/metrics`` response."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
