"""The dashboard in a real browser (headless Chromium): over a live federation server with
real agents and a running job, and over ``flotilla dashboard DIR`` following a simulation
while ``flotilla simulate`` writes it. What a person would check by looking: the job shows
up, its curve grows without a reload, every agent is listed with its state, Cancel cancels,
the console stays clean, and it fits a phone. Screenshots: ``test-artifacts/dashboard/``.
"""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.browser import (
    Console,
    chromium,
    count,
    require_browser,
    screenshot,
    texts,
    wait_for,
)
from tests.support.experiments import experiment_file
from tests.support.lifetime import bound

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

ACCURACY_POINTS = 'svg[data-chart="accuracy-round"] circle'


@pytest.fixture(scope="module", autouse=True)
def browser_present() -> None:
    require_browser()


def read_line(proc: subprocess.Popen[str], pattern: str, timeout: float) -> re.Match[str]:
    """The first stdout line of ``proc`` matching ``pattern``, within ``timeout`` seconds
    (read in a thread: a pipe's readline cannot time out)."""
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    stdout = proc.stdout
    threading.Thread(target=lambda: [lines.put(line) for line in stdout], daemon=True).start()
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        seen.append(line)
        if match := re.search(pattern, line):
            return match
    raise AssertionError(f"no line matching {pattern!r} within {timeout}s: {seen}")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start(processes: list[subprocess.Popen[str]], *args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        bound([sys.executable, "-m", "flotilla", *args]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    processes.append(proc)
    return proc


def no_reload_marker(driver: Any) -> None:
    driver.execute_script("window.__flotillaNoReload = 42")


def not_reloaded(driver: Any) -> bool:
    return bool(driver.execute_script("return window.__flotillaNoReload === 42"))


def fits_a_phone(driver: Any) -> None:
    """At 390 px wide the page itself never scrolls sideways (wide tables scroll inside)."""
    driver.set_window_size(390, 844)
    time.sleep(0.5)
    overflow = driver.execute_script(
        "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
    )
    assert overflow <= 1, f"the page is {overflow}px wider than a phone screen"


def test_a_simulation_is_watched_while_it_runs(
    tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    out = tmp_path / "out"
    # The dashboard starts first: the directory does not exist yet.
    dashboard = start(processes, "dashboard", str(out), "--port", "0", "--poll", "0.2")
    url = read_line(dashboard, r"dashboard: (http://127\.0\.0\.1:\d+/#token=\S+)", 30).group(1)
    sim = start(
        processes, "simulate", str(experiment_file(tmp_path)), "--out", str(out),
        "--no-progress", "--set", "job.rounds=30", "--set", "job.clients_per_round=6",
        "--set", "job.min_quorum=3",
    )  # fmt: skip
    with chromium() as driver:
        console = Console(driver)
        driver.get(url)
        wait_for("the token leaves the address bar", lambda: "token=" not in driver.current_url, 10)
        no_reload_marker(driver)
        wait_for("the job is listed", lambda: "small" in texts(driver, "tbody td a"), 60)
        driver.get(url.split("#")[0] + "#/jobs/job-0")  # same document: only the hash changes
        first = wait_for("a first point", lambda: count(driver, ACCURACY_POINTS), 60)
        later = wait_for(
            "more points as rounds are written",
            lambda: count(driver, ACCURACY_POINTS) > first and count(driver, ACCURACY_POINTS),
            60,
        )
        assert not_reloaded(driver), "the page reloaded"
        screenshot(driver, "simulation", "job-running", full_page=True)
        assert sim.wait(120) == 0, sim.stderr.read() if sim.stderr else ""
        wait_for("the job completes", lambda: "completed" in texts(driver, ".job-head .badge"), 30)
        final = wait_for("every round", lambda: count(driver, ACCURACY_POINTS) == 30 and 30, 30)
        assert first < later <= final
        assert count(driver, 'svg[data-chart="timeline"] rect') >= 30
        assert "Cancel job" not in driver.page_source  # a simulation cannot be cancelled
        driver.get(url.split("#")[0] + "#/devices")
        wait_for("devices listed", lambda: count(driver, "tbody tr[data-device]") > 0, 30)
        states = set(texts(driver, "tbody tr[data-device] td:nth-child(2)"))
        assert states == {"offline"}, states  # the run has ended
        assert not_reloaded(driver)
        screenshot(driver, "simulation", "devices")
        driver.get(url.split("#")[0] + "#/jobs/job-0")
        fits_a_phone(driver)
        screenshot(driver, "simulation", "job-phone", full_page=True)
        assert console.errors() == [], console.entries
