"""Each device's failed rounds by reason, counted from the event stream since the server
started: what the dashboard's device table shows beside rounds served."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from flotilla.core.events import DeviceFailed, Event


class FailureCounts:
    """An :class:`~flotilla.core.events.EventSink` that keeps ``device -> reason -> n``."""

    def __init__(self) -> None:
        self._counts: dict[str, Counter[str]] = {}

    def emit(self, event: Event) -> None:
        if isinstance(event, DeviceFailed):
            self._counts.setdefault(event.device_id, Counter())[event.reason] += 1

    def of(self, device_id: str) -> Mapping[str, int]:
        """A fresh ``reason -> count`` for one device (empty when it never failed)."""
        return dict(self._counts.get(device_id, {}))

    def all(self) -> Mapping[str, Mapping[str, int]]:
        """Fresh ``device -> reason -> count`` for every device that failed a round."""
        return {device: dict(counts) for device, counts in self._counts.items()}
