"""The headless browser the dashboard tests drive: Debian's Chromium through its chromedriver (``make test``
installs both when missing; no browser download)."""

from __future__ import annotations

import shutil
from typing import Any, Iterator

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    options = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000",
                "--disable-gpu"):
        options.add_argument(arg)
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver") or
                                                                "/usr/bin/chromedriver"))
    try:
        yield driver
    finally:
        driver.quit()
