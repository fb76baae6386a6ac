"""Where an agent learns its own conditions: a JSON file, or what the OS exposes.

``flotilla client --conditions FILE`` reads a JSON object (``charging``, ``battery`` 0..1,
``network`` unmetered|metered|unknown, ``idle``, optionally ``thermal``) at every poll and
heartbeat, so whoever manages the device (or a test) can change them while it runs.
Without a file the agent reads Linux's ``/sys/class/power_supply`` (mains or USB online;
a battery's capacity and status) and, where psutil is installed, its battery sensor.
The OS says nothing reliable about metered networks or user idleness: both stay unknown
(and unknown never meets a job's requirement) unless a file says otherwise.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from flotilla.core.conditions import DeviceConditions
from flotilla.core.errors import WireError

log = logging.getLogger(__name__)

#: A source of the device's current conditions, asked at every poll and heartbeat.
ConditionsSource = Callable[[], DeviceConditions]
#: Where Linux lists power supplies.
POWER_SUPPLY = Path("/sys/class/power_supply")
#: The largest conditions file read (the object has five fields).
MAX_FILE_BYTES = 64 * 1024


def read_conditions_file(path: Path) -> DeviceConditions:
    """The conditions ``path`` holds; WireError (naming the file) when it cannot be read
    or is not a conditions object."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise WireError(f"conditions file {path}: {exc.strerror or exc}") from exc
    if len(raw) > MAX_FILE_BYTES:
        raise WireError(f"conditions file {path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"conditions file {path}: not valid JSON: {exc}") from exc
    return DeviceConditions.from_dict(data, f"conditions file {path}")


class ConditionsFile:
    """Re-reads the file at each call. A file caught half-written (or briefly missing)
    keeps the last good reading, with a warning, rather than failing a round."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._last = read_conditions_file(path)  # a bad file fails the agent at start

    def __call__(self) -> DeviceConditions:
        try:
            self._last = read_conditions_file(self.path)
        except WireError as exc:
            log.warning("%s; keeping the last reading", exc)
        return self._last


def system_conditions(root: Path = POWER_SUPPLY) -> DeviceConditions:
    """Power and battery as the OS reports them (network, idleness: unknown)."""
    charging, battery = _power_supply(root)
    if charging is None and battery is None:
        charging, battery = _psutil_battery()
    return DeviceConditions(charging=charging, battery=battery)


def _power_supply(root: Path) -> tuple[bool | None, float | None]:
    """(charging, battery 0..1) from ``/sys/class/power_supply``; None where it says nothing."""
    charging: bool | None = None
    battery: float | None = None
    try:
        supplies = sorted(root.iterdir())
    except OSError:
        return None, None
    for supply in supplies:
        kind = _read(supply / "type")
        if kind in ("Mains", "USB", "USB_C", "USB_PD") and _read(supply / "online") in ("0", "1"):
            charging = bool(charging) or _read(supply / "online") == "1"
        elif kind == "Battery":
            capacity = _read(supply / "capacity")
            if capacity.isdigit():
                battery = min(int(capacity), 100) / 100.0
            status = _read(supply / "status")
            if status in ("Charging", "Full"):
                charging = True
            elif status in ("Discharging", "Not charging") and charging is None:
                charging = False
    return charging, battery


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()[:64]
    except OSError:
        return ""


def _psutil_battery() -> tuple[bool | None, float | None]:
    try:
        import psutil
    except ImportError:
        return None, None
    try:
        sensed = psutil.sensors_battery()
    except (AttributeError, OSError, RuntimeError):  # not every platform has the sensor
        return None, None
    if sensed is None:
        return None, None
    percent = max(0.0, min(float(sensed.percent), 100.0))
    plugged = sensed.power_plugged
    return (None if plugged is None else bool(plugged)), percent / 100.0


def conditions_source(path: Path | None) -> ConditionsSource:
    """The file's conditions when ``path`` is given, else the OS's."""
    return ConditionsFile(path) if path is not None else system_conditions


__all__ = [
    "ConditionsFile",
    "ConditionsSource",
    "conditions_source",
    "read_conditions_file",
    "system_conditions",
]
