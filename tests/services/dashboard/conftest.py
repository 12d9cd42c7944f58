"""The headless browser the dashboard tests drive (tests/support/browser.py)."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from tests.support.browser import chrome


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = chrome()
    try:
        yield driver
    finally:
        driver.quit()
