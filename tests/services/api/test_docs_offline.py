"""``/docs`` renders offline: Swagger UI's script and styles come from the server itself (fetched from the npm
registry at install time, shipped in the wheel), never from a CDN. Checked in headless Chromium whose host
resolver knows only 127.0.0.1, against a real ``trainguard serve``."""

from __future__ import annotations

import re
import shutil
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.services.e2e.serve_process import ServeProcess


def offline_chrome() -> webdriver.Chrome:
    """Headless Chromium (as tests/support/browser.py) whose resolver fails every name but 127.0.0.1."""
    options = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000",
                "--disable-gpu", "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"):
        options.add_argument(arg)
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    return webdriver.Chrome(options=options,
                            service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    proc = ServeProcess(tmp_path_factory.mktemp("docs") / "data").start()
    try:
        yield proc
    finally:
        proc.stop()


def test_docs_page_loads_nothing_from_elsewhere(server: ServeProcess) -> None:
    with urllib.request.urlopen(server.http_url + "/docs", timeout=10) as response:
        page = response.read().decode()
    urls = re.findall(r"""(?:src|href)\s*=\s*['"]([^'"]+)['"]""", page)
    assert urls and all(u.startswith("/") for u in urls), urls  # no http(s):// anywhere
    assert re.findall(r"https?://", page) == [], page
    for url in urls:  # each asset is served here
        with urllib.request.urlopen(server.http_url + url, timeout=10) as asset:
            assert asset.status == 200 and len(asset.read()) > 100_000


def test_docs_render_in_a_browser_without_internet(server: ServeProcess, tmp_path: Path) -> None:
    driver = offline_chrome()
    try:
        driver.get(server.http_url + "/docs")

        def rendered(d: object) -> bool:
            title = driver.find_elements(By.CSS_SELECTOR, ".swagger-ui .info .title")
            paths = driver.find_elements(By.CSS_SELECTOR, ".swagger-ui .opblock-summary-path")
            return bool(title) and "TrainGuard" in title[0].text and \
                any(p.text.replace("\u200b", "") == "/api/v1/runs" for p in paths)

        WebDriverWait(driver, 30, ignored_exceptions=[StaleElementReferenceException]).until(rendered)
        driver.save_screenshot(str(tmp_path / "docs.png"))
    finally:
        driver.quit()
