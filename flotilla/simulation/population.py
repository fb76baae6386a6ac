"""Virtual devices: who they are (speed, links) and when they are online.

A population is drawn from device classes (each a share of the fleet with lognormal
compute speed and bandwidths) or read from a CSV trace, one row per device. Availability
is a process per device: always on, exponential on/off sessions, or a daily window
(diurnal). Everything is drawn from the population's seed, so a run is reproducible.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flotilla.core.errors import SpecError

DAY_S = 86_400.0


@dataclass(frozen=True, slots=True)
class DeviceClass:
    """A kind of device and its share of the fleet. Speeds and bandwidths are lognormal:
    ``*_median`` is the median, ``sigma`` the spread of the underlying normal."""

    name: str = "laptop"
    share: float = 1.0
    #: Relative compute speed: 1.0 trains a sample in ``population.seconds_per_sample``.
    speed_median: float = 1.0
    speed_sigma: float = 0.5
    upload_mbps: float = 20.0
    download_mbps: float = 50.0
    bandwidth_sigma: float = 0.5
    latency_ms: float = 50.0


@dataclass(frozen=True, slots=True)
class AvailabilitySection:
    """When devices are online.

    ``always``; ``exponential``: sessions alternate on/off with the given means;
    ``diurnal``: each device is online ``online_hours`` a day, starting at an hour drawn
    uniformly per device (time 0 is midnight).
    """

    kind: str = "always"
    mean_on_s: float = 3600.0
    mean_off_s: float = 1800.0
    online_hours: float = 8.0


@dataclass(frozen=True, slots=True)
class PopulationSection:
    """The virtual fleet of an experiment (``[population]``)."""

    clients: int = 100
    #: Seed of profiles, availability and dropouts; -1 uses the experiment's seed.
    seed: int = -1
    #: Simulated seconds to train one sample at speed 1.0.
    seconds_per_sample: float = 0.002
    #: Chance that a selected device drops out mid-round (it never reports).
    dropout: float = 0.0
    #: Seconds until the engine hears of a dropout (a real server: its liveness timeout).
    dropout_detect_s: float = 30.0
    #: CSV trace of device profiles (see docs/simulation.md); overrides ``classes``.
    trace: str = ""
    #: ``random``, or ``ascending``: device index follows compute speed (device 0 the
    #: slowest), so a task whose data follows the shard index (the digits task's
    #: ``label_skew = "by_index"``) gives slow devices different data than fast ones.
    speed_order: str = "random"
    classes: tuple[DeviceClass, ...] = (DeviceClass(),)
    availability: AvailabilitySection = field(default_factory=AvailabilitySection)
    #: A device's true compute time is its profile's times lognormal(0, sigma): the
    #: scheduler sees the profile, rounds take the truth (enrolment benchmarks are noisy).
    profile_noise_sigma: float = 0.0
    #: Each round's time on each device is multiplied by lognormal(0, sigma).
    round_noise_sigma: float = 0.0
    #: Share of devices that throttle: from a time drawn per device (exponential, mean
    #: ``throttle_after_s``) on, they compute ``throttle_factor`` times slower.
    throttle_share: float = 0.0
    throttle_factor: float = 3.0
    throttle_after_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.clients < 1:
            raise SpecError(f"population.clients must be >= 1, got {self.clients}")
        if self.speed_order not in ("random", "ascending"):
            raise SpecError(
                f"population.speed_order must be random or ascending, got {self.speed_order!r}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise SpecError(f"population.dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 <= self.throttle_share <= 1.0 or not self.throttle_factor >= 1.0:
            raise SpecError("population.throttle_share must be in [0, 1], throttle_factor >= 1")
        for name in (
            "seconds_per_sample",
            "dropout_detect_s",
            "profile_noise_sigma",
            "round_noise_sigma",
            "throttle_after_s",
        ):
            value = getattr(self, name)
            if not value >= 0 or not math.isfinite(value):
                raise SpecError(f"population.{name} must be >= 0, got {value}")
        if not self.trace and (not self.classes or sum(c.share for c in self.classes) <= 0):
            raise SpecError("population.classes needs at least one class with a share > 0")
        for c in self.classes:
            if c.share < 0 or min(c.speed_median, c.upload_mbps, c.download_mbps) <= 0:
                raise SpecError(
                    f"population.classes '{c.name}': share must be >= 0 and speeds and "
                    "bandwidths > 0"
                )
        kinds = ("always", "exponential", "diurnal")
        avail = self.availability
        if avail.kind not in kinds:
            raise SpecError(
                f"population.availability.kind {avail.kind!r} is not one of {', '.join(kinds)}"
            )
        if min(avail.mean_on_s, avail.mean_off_s) <= 0 or not 0 < avail.online_hours <= 24:
            raise SpecError(
                "population.availability: means must be > 0 and online_hours in (0, 24]"
            )


@dataclass(frozen=True, slots=True)
class VirtualDevice:
    index: int
    device_id: str
    kind: str
    speed: float
    upload_bytes_per_s: float
    download_bytes_per_s: float
    latency_s: float

    def compute_seconds(self, samples: int, epochs: int, seconds_per_sample: float) -> float:
        return samples * epochs * seconds_per_sample / self.speed

    def round_seconds(
        self, samples: int, epochs: int, seconds_per_sample: float, down: int, up: int
    ) -> float:
        """Compute + transfer + latency (once each way)."""
        compute = self.compute_seconds(samples, epochs, seconds_per_sample)
        transfer = down / self.download_bytes_per_s + up / self.upload_bytes_per_s
        return compute + transfer + 2 * self.latency_s


@dataclass(frozen=True, slots=True)
class Slowdowns:
    """How much slower than its profile each device computes (``profile_noise_sigma``,
    ``throttle_*``) and how noisy its rounds are (``round_noise_sigma``), drawn from
    streams of their own: with every option off, nothing is drawn and runs are unchanged."""

    #: Per device (by index): true compute time / the profile's.
    factor: tuple[float, ...]
    #: Per device: when it starts to throttle (inf: never).
    throttle_at: tuple[float, ...]
    throttle_factor: float = 1.0
    round_sigma: float = 0.0

    @classmethod
    def draw(cls, spec: PopulationSection, seed: int) -> Slowdowns:
        n = spec.clients
        factor = np.ones(n)
        if spec.profile_noise_sigma > 0:
            rng = np.random.default_rng([seed % 2**32, 4])
            factor = np.exp(spec.profile_noise_sigma * rng.standard_normal(n))
        throttle_at = np.full(n, math.inf)
        if spec.throttle_share > 0:
            rng = np.random.default_rng([seed % 2**32, 5])
            chosen = rng.random(n) < spec.throttle_share
            onset = rng.exponential(spec.throttle_after_s, n)
            throttle_at[chosen] = onset[chosen]
        return cls(
            tuple(factor.tolist()),
            tuple(throttle_at.tolist()),
            spec.throttle_factor,
            spec.round_noise_sigma,
        )

    @property
    def active(self) -> bool:
        return (
            self.round_sigma > 0
            or any(f != 1.0 for f in self.factor)
            or any(math.isfinite(t) for t in self.throttle_at)
        )

    def compute_factor(self, index: int, now: float) -> float:
        """True compute time over the profile's for device ``index`` at time ``now``."""
        throttled = now >= self.throttle_at[index]
        return self.factor[index] * (self.throttle_factor if throttled else 1.0)


#: Columns of a trace CSV; ``class`` is optional.
TRACE_COLUMNS = ("speed", "upload_mbps", "download_mbps", "latency_ms")


def draw_devices(spec: PopulationSection, seed: int) -> list[VirtualDevice]:
    """The fleet: from the trace when one is given, else drawn from the classes."""
    devices = _from_trace(Path(spec.trace), spec.clients) if spec.trace else _draw(spec, seed)
    if spec.speed_order == "ascending":
        by_speed = sorted(devices, key=lambda d: (d.speed, d.index))
        devices = [
            dataclasses.replace(d, index=i, device_id=f"sim-{i:06d}")
            for i, d in enumerate(by_speed)
        ]
    return devices


def _draw(spec: PopulationSection, seed: int) -> list[VirtualDevice]:
    rng = np.random.default_rng([seed % 2**32, 0])
    shares = np.array([c.share for c in spec.classes], dtype=np.float64)
    kinds = rng.choice(len(spec.classes), size=spec.clients, p=shares / shares.sum())
    z = rng.standard_normal((spec.clients, 3))
    devices = []
    for i, k in enumerate(kinds.tolist()):
        c = spec.classes[k]
        up = c.upload_mbps * math.exp(c.bandwidth_sigma * z[i, 1])
        down = c.download_mbps * math.exp(c.bandwidth_sigma * z[i, 2])
        devices.append(
            VirtualDevice(
                index=i,
                device_id=f"sim-{i:06d}",
                kind=c.name,
                speed=c.speed_median * math.exp(c.speed_sigma * z[i, 0]),
                upload_bytes_per_s=up * 1e6 / 8,
                download_bytes_per_s=down * 1e6 / 8,
                latency_s=c.latency_ms / 1000.0,
            )
        )
    return devices


def _from_trace(path: Path, clients: int) -> list[VirtualDevice]:
    try:
        with path.open(newline="") as fh:
            rows = list(csv.DictReader(fh))
    except OSError as exc:
        raise SpecError(f"population.trace: cannot read {path}: {exc}") from exc
    if not rows:
        raise SpecError(f"population.trace: {path} has no rows")
    missing = [c for c in TRACE_COLUMNS if c not in rows[0]]
    if missing:
        raise SpecError(
            f"population.trace: {path} lacks column(s) {', '.join(missing)} "
            f"(needs {', '.join(TRACE_COLUMNS)}; optional: class)"
        )
    devices = []
    for i in range(clients):
        row = rows[i % len(rows)]  # a short trace is cycled over a larger fleet
        try:
            speed, up, down, latency = (float(row[c]) for c in TRACE_COLUMNS)
        except ValueError as exc:
            raise SpecError(f"population.trace: {path} row {i % len(rows) + 2}: {exc}") from exc
        if min(speed, up, down) <= 0 or latency < 0:
            raise SpecError(
                f"population.trace: {path} row {i % len(rows) + 2}: speed and bandwidths "
                "must be > 0 and latency >= 0"
            )
        devices.append(
            VirtualDevice(
                index=i,
                device_id=f"sim-{i:06d}",
                kind=row.get("class") or "trace",
                speed=speed,
                upload_bytes_per_s=up * 1e6 / 8,
                download_bytes_per_s=down * 1e6 / 8,
                latency_s=latency / 1000.0,
            )
        )
    return devices


def sessions(spec: AvailabilitySection, seed: int, index: int) -> Iterator[tuple[float, bool]]:
    """``(time, online)`` transitions of one device, from time 0 on, without end
    (``always`` yields one). The first item is the state at time 0."""
    rng = np.random.default_rng([seed % 2**32, 1, index])
    if spec.kind == "always":
        yield 0.0, True
        return
    if spec.kind == "exponential":
        on_share = spec.mean_on_s / (spec.mean_on_s + spec.mean_off_s)
        online = bool(rng.random() < on_share)
        t = 0.0
        yield t, online
        while True:
            t += float(rng.exponential(spec.mean_on_s if online else spec.mean_off_s))
            online = not online
            yield t, online
    start = float(rng.uniform(0.0, DAY_S))
    length = spec.online_hours * 3600.0
    if length >= DAY_S:
        yield 0.0, True
        return
    # Online on [start + k*DAY, start + length + k*DAY) for every day k.
    online = start == 0.0 or start + length > DAY_S
    yield 0.0, online
    day = -1.0
    while True:
        for t, state in ((start + day * DAY_S, True), (start + length + day * DAY_S, False)):
            if t > 0.0 and state != online:
                online = state
                yield t, state
        day += 1.0
