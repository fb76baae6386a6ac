"""Headless Chromium for the dashboard's browser tests: Debian's ``chromium`` driven through
``chromium-driver`` with Selenium, its console log read back, screenshots kept.

``make test`` installs both when missing and it may (``make browser``). Without them a test
skips, except under ``CI=true``, where a missing browser is a failure: CI must run it.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Screenshots land here (gitignored), one folder per test module.
ARTIFACTS = ROOT / "test-artifacts" / "dashboard"

T = TypeVar("T")


def _find(*names: str) -> str | None:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
        if Path(f"/usr/bin/{name}").exists():  # PATH may be trimmed in a test's environment
            return f"/usr/bin/{name}"
    return None


def require_browser() -> tuple[str, str]:
    """Chromium's and chromedriver's paths; skips (fails under ``CI=true``) without them."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing = "the selenium package (pip install -e '.[dev]')"
    else:
        chromium = _find("chromium", "chromium-browser")
        driver = _find("chromedriver")
        if chromium and driver:
            return chromium, driver
        missing = "Debian's chromium and chromium-driver (make browser, as root)"
    message = f"the dashboard's browser test needs {missing}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message}; CI=true, so this is a failure, not a skip")
    pytest.skip(message)


def open_chromium(width: int = 1280, height: int = 900) -> Any:
    """A headless Chromium (a Selenium driver) that keeps its console log; the caller quits
    it. Blocking: from a test whose event loop serves the page, call it in a thread."""
    binary, driver_path = require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = binary
    for arg in (
        "--headless=new",
        "--no-sandbox",  # tests may run as root, in a container
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        f"--window-size={width},{height}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    return driver


@contextmanager
def chromium(width: int = 1280, height: int = 900) -> Iterator[Any]:
    """:func:`open_chromium`, quit on the way out."""
    driver = open_chromium(width, height)
    try:
        yield driver
    finally:
        driver.quit()


class Console:
    """Everything the page wrote to its console, collected as the test goes."""

    def __init__(self, driver: Any) -> None:
        self._driver = driver
        self.entries: list[dict[str, Any]] = []

    def collect(self) -> list[dict[str, Any]]:
        self.entries.extend(self._driver.get_log("browser"))
        return self.entries

    def errors(self) -> list[dict[str, Any]]:
        return [e for e in self.collect() if e.get("level") == "SEVERE"]


def screenshot(driver: Any, folder: str, name: str, full_page: bool = False) -> Path:
    """Saves a PNG under ``test-artifacts/dashboard/FOLDER/`` and prints where."""
    out = ARTIFACTS / folder
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    size = driver.get_window_size()
    if full_page:
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(size["width"], min(int(height) + 40, 6000))
    try:
        driver.save_screenshot(str(path))
    finally:
        if full_page:
            driver.set_window_size(size["width"], size["height"])
    print(f"screenshot: {path}")
    return path


def wait_for(what: str, check: Callable[[], T | None], timeout: float, every: float = 0.2) -> T:
    """``check()``'s first truthy answer within ``timeout`` seconds; fails saying ``what``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout}s (last: {last!r})")


def count(driver: Any, selector: str) -> int:
    return int(
        driver.execute_script("return document.querySelectorAll(arguments[0]).length", selector)
    )


def texts(driver: Any, selector: str) -> list[str]:
    return list(
        driver.execute_script(
            "return [...document.querySelectorAll(arguments[0])].map(e => e.textContent.trim())",
            selector,
        )
    )
