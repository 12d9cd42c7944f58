"""Driving the dashboard in a browser: Debian's Chromium through its chromedriver (``make test`` installs
both when missing; no browser download), and waiting on a page that re-renders -- the dashboard replaces
elements as data arrives, so an element found a moment ago may be stale by the time it is read."""

from __future__ import annotations

import shutil
from typing import Any

from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait


def shows(driver: Any, element_id: str, text: str, timeout: float = 30.0) -> None:
    """Wait until the element with ``element_id`` shows ``text`` (re-finding it on every try)."""
    WebDriverWait(driver, timeout, ignored_exceptions=[StaleElementReferenceException]).until(
        lambda d: text in d.find_element(By.ID, element_id).text)


def chrome() -> Any:
    """A headless Chromium (1400x1000); the caller quits it."""
    options = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000",
                "--disable-gpu"):
        options.add_argument(arg)
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    return webdriver.Chrome(options=options,
                            service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"))
