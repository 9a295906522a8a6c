"""Headless Debian chromium through Selenium, for the dashboard's browser test and
``make screenshot`` (Debian packages ``chromium`` and ``chromium-driver``)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


def missing() -> str | None:
    """Why no browser can run here, or None."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not path.exists():
            return f"{path} is missing: apt-get install -y chromium chromium-driver"
    return None


@contextmanager
def chromium(width: int = 1400, height: int = 1000) -> Iterator[object]:
    """A headless chromium (a ``selenium.webdriver.Chrome``) with a fresh profile, no network
    of its own (no updates, sync or background fetches), quit and its profile removed on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory(prefix="viiwork-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                    f"--user-data-dir={profile}", f"--window-size={width},{height}"):
            options.add_argument(arg)
        driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
        try:
            yield driver
        finally:
            driver.quit()
