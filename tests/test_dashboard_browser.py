"""The dashboard in a real browser (headless Chromium): over a live federation server with
real agents and a running job, and over ``flotilla dashboard DIR`` following a simulation
while ``flotilla simulate`` writes it. What a person would check by looking: the job shows
up, its curve grows without a reload, every agent is listed with its state, Cancel cancels,
the console stays clean, and it fits a phone. Screenshots: ``test-artifacts/dashboard/``.
"""

from __future__ import annotations

import asyncio
import os
import queue
import re
import signal
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
    open_chromium,
    require_browser,
    screenshot,
    texts,
    wait_for,
)
from tests.support.experiments import experiment_file
from tests.support.lifetime import bound

pytestmark = pytest.mark.timeout(240)

ACCURACY_POINTS = 'svg[data-chart="accuracy-round"] circle'


def test_a_missing_browser_fails_under_ci_and_skips_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.support import browser

    monkeypatch.setattr(browser, "_find", lambda *names: None)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        require_browser()
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="chromium"):
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


@pytest.mark.slow
def test_a_simulation_is_watched_while_it_runs(
    tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    require_browser()
    out = tmp_path / "out"
    # The dashboard starts first: the directory does not exist yet.
    dashboard = start(processes, "dashboard", str(out), "--port", "0", "--poll", "0.2")
    url = read_line(dashboard, r"dashboard: (http://127\.0\.0\.1:\d+/#token=\S+)", 30).group(1)
    sim = start(
        processes, "simulate", str(experiment_file(tmp_path)), "--out", str(out),
        "--no-progress", "--set", "job.rounds=30", "--set", "job.clients_per_round=6",
        "--set", "job.min_quorum=3",
    )  # fmt: skip
    # Its 30 rounds take about a second on this machine, less than a page needs to start:
    # the run is held (SIGSTOP) after its first rounds, so the page surely meets it midway.
    metrics = out / "metrics.jsonl"
    wait_for(
        "a first round written", lambda: metrics.exists() and metrics.read_text(), 60, every=0.02
    )
    os.kill(sim.pid, signal.SIGSTOP)
    with chromium() as driver:
        console = Console(driver)
        driver.get(url)
        wait_for("the token leaves the address bar", lambda: "token=" not in driver.current_url, 10)
        no_reload_marker(driver)
        wait_for("the job is listed", lambda: "small" in texts(driver, "tbody td a"), 60)
        driver.get(url.split("#")[0] + "#/jobs/job-0")  # same document: only the hash changes
        first = wait_for("a first point", lambda: count(driver, ACCURACY_POINTS), 60)
        assert first < 30, first
        os.kill(sim.pid, signal.SIGCONT)
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


# --- a live federation -------------------------------------------------------------------


def sign_in_by_hand(driver: Any, base: str, read_token: str, job_id: str, console: Console) -> None:
    """No token in the URL: the page asks for one, says so when it is refused, keeps a good
    one for the tab, and shows a read token no Cancel button."""
    driver.get(base + "/")
    wait_for("the token form", lambda: driver.find_element("id", "token-panel").is_displayed(), 10)
    field = driver.find_element("id", "token-input")
    field.send_keys("not-a-token")
    driver.find_element("css selector", "#token-form button").click()
    wait_for(
        "told it was refused",
        lambda: "refused" in driver.find_element("id", "token-error").text,
        10,
    )
    refused = console.errors()  # Chrome reports the 401 answer itself on the console
    assert refused and all("401" in e["message"] for e in refused), refused
    console.entries.clear()
    field.send_keys(read_token)
    driver.find_element("css selector", "#token-form button").click()
    wait_for("the job is listed", lambda: "watched" in texts(driver, "tbody td a"), 30)
    assert driver.execute_script("return sessionStorage.getItem('flotilla.token')") == read_token
    assert "read-only" in driver.find_element("id", "whoami").text
    driver.execute_script("location.hash = arguments[0]", f"#/jobs/{job_id}")
    wait_for("the job's page", lambda: count(driver, ".job-head"), 10)
    assert not driver.find_elements("id", "cancel-job")  # a read token cannot cancel


def watch_the_job(driver: Any, url: str, job_id: str, agents: set[str]) -> None:
    """The job appears, its accuracy curve grows without a reload, every agent is listed."""
    driver.get(url)  # the operator's token now, in the fragment
    wait_for("the token leaves the address bar", lambda: "token=" not in driver.current_url, 10)
    wait_for(
        "signed in as operator", lambda: "operator" in driver.find_element("id", "whoami").text, 10
    )
    no_reload_marker(driver)
    wait_for("the job is listed", lambda: "watched" in texts(driver, "tbody td a"), 30)
    screenshot(driver, "server", "jobs")
    driver.execute_script("location.hash = arguments[0]", f"#/jobs/{job_id}")
    first = wait_for("a first point", lambda: count(driver, ACCURACY_POINTS), 60)
    later = wait_for(
        "more points as rounds commit",
        lambda: count(driver, ACCURACY_POINTS) > first and count(driver, ACCURACY_POINTS),
        60,
    )
    assert later > first and not_reloaded(driver)
    assert "running" in texts(driver, ".job-head .badge")
    screenshot(driver, "server", "job-running", full_page=True)
    driver.execute_script("location.hash = '#/devices'")
    rows = wait_for(
        "every agent in the device table",
        lambda: (found := device_rows(driver)) and set(found) == agents and found,
        30,
    )
    assert set(rows.values()) <= {"idle", "busy"}, rows
    screenshot(driver, "server", "devices")
    assert not_reloaded(driver)


def device_rows(driver: Any) -> dict[str, str]:
    """The device table: id -> the state shown."""
    return dict(
        driver.execute_script(
            "return [...document.querySelectorAll('tbody tr[data-device]')]"
            ".map(r => [r.cells[0].textContent, r.cells[1].textContent])"
        )
    )


def cancel_from_the_page(driver: Any, job_id: str) -> None:
    driver.execute_script("location.hash = arguments[0]", f"#/jobs/{job_id}")
    button = wait_for("the Cancel button", lambda: driver.find_elements("id", "cancel-job"), 30)
    button[0].click()
    confirm = wait_for("asked to confirm", lambda: driver.find_elements("id", "confirm-cancel"), 10)
    screenshot(driver, "server", "cancel-confirm")
    confirm[0].click()


def sees_it_cancelled(driver: Any) -> None:
    wait_for("shown cancelled", lambda: "cancelled" in texts(driver, ".job-head .badge"), 30)
    assert not driver.find_elements("id", "cancel-job")  # nothing left to cancel
    assert not_reloaded(driver)
    fits_a_phone(driver)
    screenshot(driver, "server", "job-phone", full_page=True)


@pytest.mark.slow
async def test_a_live_federation_is_watched_and_its_job_cancelled(
    tmp_path: Path, process_db_url: str
) -> None:
    require_browser()
    from tests.support.http_server import http_server, quick_toml, wait_until

    async with http_server(tmp_path / "state", process_db_url) as srv:
        await srv.fleet.start_agents(3)
        await srv.fleet.wait_devices(3, timeout=60)
        agents = {d["id"] for d in await srv.fleet.devices()}
        status, job = await srv.submit_toml(quick_toml("watched", rounds=200, clients=2))
        assert status == 201, job
        url = f"{srv.base}/#token={srv.operator_token}"
        driver = await asyncio.to_thread(open_chromium)
        try:
            console = Console(driver)
            await asyncio.to_thread(
                sign_in_by_hand, driver, srv.base, srv.read_token, job["id"], console
            )
            await asyncio.to_thread(watch_the_job, driver, url, job["id"], agents)
            await asyncio.to_thread(cancel_from_the_page, driver, job["id"])

            async def cancelled() -> bool:
                record = await srv.server.store.get_job(job["id"])
                return record is not None and record.state == "cancelled"

            await wait_until(cancelled, 30, "the job cancelled in the store")
            await asyncio.to_thread(sees_it_cancelled, driver)
            errors = await asyncio.to_thread(console.errors)
            assert errors == [], console.entries
        finally:
            await asyncio.to_thread(driver.quit)
