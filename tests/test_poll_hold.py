"""``flotilla server --poll-hold``: how long an idle device's poll is held before its empty
answer (proxies that cut idle requests after a few seconds need it short)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from flotilla.core.device import DeviceProfile
from flotilla.mobile.lite.http import HttpDevice
from tests.support.processes import DIGITS, ServerProcess, flotilla


@pytest.mark.timeout(90)
def test_an_idle_poll_is_answered_after_the_hold_given(tmp_path: Path) -> None:
    # Without the flag, --liveness 60 would hold each poll 10 s (the default hold).
    server = ServerProcess(tmp_path / "state", extra=("--liveness", "60", "--poll-hold", "0.5"))
    server.start()
    try:
        device = HttpDevice(f"http://127.0.0.1:{server.http_port}")
        device.enrol(server.token(), DeviceProfile("", tasks=(DIGITS,)))
        held = []
        for _ in range(3):
            began = time.monotonic()
            assert device.poll() is None  # no job: an empty answer, after the hold
            held.append(time.monotonic() - began)
    finally:
        server.stop()
    assert min(held) >= 0.45 and max(held) < 5.0, held


def test_a_negative_hold_is_refused_before_the_server_starts(tmp_path: Path) -> None:
    out = flotilla(
        "server", "--port", "0", "--no-http", "--state-dir", str(tmp_path / "state"),
        "--poll-hold", "-1", check=False,
    )  # fmt: skip
    assert out.returncode != 0
    assert "--poll-hold must be 0 or more seconds" in out.stderr
    assert not (tmp_path / "state").exists()  # refused before anything was written
