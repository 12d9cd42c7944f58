"""Waiting on a page that re-renders: the dashboard replaces elements as data arrives, so an element found
a moment ago may be stale by the time it is read."""

from __future__ import annotations

from typing import Any

from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait


def shows(driver: Any, element_id: str, text: str, timeout: float = 30.0) -> None:
    """Wait until the element with ``element_id`` shows ``text`` (re-finding it on every try)."""
    WebDriverWait(driver, timeout, ignored_exceptions=[StaleElementReferenceException]).until(
        lambda d: text in d.find_element(By.ID, element_id).text)
