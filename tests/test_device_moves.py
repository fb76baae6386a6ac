"""Idle devices move to the server of a deployment whose jobs lack them: when another
server announces that its waiting jobs lack devices of a task, this one sends that many of
its idle devices of that task on (their next poll is answered "try the next server"), and
no more; a device this server's own jobs need stays. Another server is the store's
announcement here, so the count is exact; ``tests/faults/test_two_servers.py`` moves
devices between two real server processes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from flotilla.core.events import DeviceChanged, Event
from flotilla.core.records import ServerPresence
from flotilla.core.timeouts import Timeouts
from tests.support.inproc import DIGITS, SERVER_TIMEOUTS, in_process_federation, poll_until

#: A tick (a third of the lease) every second: moves are planned once a second.
TIMEOUTS = Timeouts(liveness_s=SERVER_TIMEOUTS.liveness_s, job_lease_s=3.0, poll_hold_s=1.0)
ELSEWHERE = "another-host:1:abcdef01"


class Departures:
    """Devices that went offline here, in order."""

    def __init__(self) -> None:
        self.devices: list[str] = []

    def emit(self, event: Event) -> None:
        if isinstance(event, DeviceChanged) and event.state == "offline":
            self.devices.append(event.device_id)


async def test_idle_devices_go_where_another_servers_jobs_lack_them_and_no_more(
    tmp_path: Path, db_url: str
) -> None:
    departures = Departures()
    async with in_process_federation(
        tmp_path / "state", db_url, timeouts=TIMEOUTS, sinks=(departures,)
    ) as fed:
        await fed.start_agents(3, task=DIGITS)
        await fed.wait_devices(3, timeout=60)
        elsewhere = ServerPresence(ELSEWHERE, time.time() + 60, ((DIGITS, 2), ("other", 5)))
        await fed.store.announce(elsewhere)

        async def two_left() -> bool:
            return len(departures.devices) >= 2

        assert await poll_until(two_left, 30), departures.devices
        await fed.store.withdraw(ELSEWHERE)  # its jobs got what they lacked
        await asyncio.sleep(2.5)  # two more ticks: nothing else moves
        assert len(departures.devices) == 2, departures.devices
        assert len(set(departures.devices)) == 2
        # Sent on, the agents try the next server: here the only one, so they come back.
        await fed.wait_devices(3, timeout=60)
