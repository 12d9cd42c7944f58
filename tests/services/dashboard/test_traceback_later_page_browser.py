"""The incident page's traceback is the exception the incident rests on, wherever it is among the run's
exceptions. The panel looked for the evidence's event in the first page of ``kinds=exception&limit=200``;
pages end at ``api_max_page_bytes`` (H26), so with many fat exceptions before it the event was on a later page
and the panel showed the run's first exception instead (a handled one, here). It now reads the event by its
id (``GET /api/v1/runs/{run}/events/{event_id}``). Headless Chromium against a real ``trainguard serve``
whose page bound is lowered so that the first page holds a handful of exceptions."""

from __future__ import annotations

import time
import uuid
from typing import Any, Dict, Iterator

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.services.dashboard.test_dashboard_browser import loaded
from tests.services.e2e.serve_process import ServeProcess
from tests.support.waiting import poll

RUN = "traceback-later-page"
HANDLED = 24  # handled exceptions (no incident) of ~6 KB each before the crash: several pages at 16 KiB


def _exception(step: int, message: str, handled: bool) -> Dict[str, Any]:
    return {"event_id": uuid.uuid4().hex, "run_id": RUN, "step": step, "time_unix_nano": time.time_ns(),
            "severity": "WARNING" if handled else "CRITICAL",
            "exception": {"type": "ValueError" if handled else "RuntimeError", "message": message,
                          "handled": handled,
                          "frames": [{"filename": "/app/train.py", "module": "train", "function": f"step_{step}",
                                      "lineno": 10 + step, "in_app": True}]}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    srv = ServeProcess(tmp_path_factory.mktemp("later-page") / "data",
                       env={"TRAINGUARD_API_MAX_PAGE_BYTES": str(16 * 1024)}).start()
    try:
        events = [_exception(s, f"handled {s} " + "h" * 6000, True) for s in range(HANDLED)]
        events.append(_exception(HANDLED, "the crash: mat1 and mat2 shapes cannot be multiplied", False))
        r = httpx.post(srv.http_url + "/v1/ingest", json={"events": events}, timeout=30,
                       headers={"Authorization": f"Bearer {srv.tokens['ingest']}"})
        assert r.json()["accepted"] == HANDLED + 1, r.text
        assert poll(lambda: (srv.get_or_none(f"/api/v1/runs/{RUN}/incidents") or {}).get("items"), 60)
        yield srv
    finally:
        srv.stop()


def test_the_traceback_is_the_incidents_exception_on_a_later_page(server: ServeProcess, browser: Any) -> None:
    (incident,) = server.get(f"/api/v1/runs/{RUN}/incidents")["items"]
    (evidence_id,) = {e["event_id"] for e in incident["evidence"] if e.get("event_id")}
    first = server.get(f"/api/v1/runs/{RUN}/events", kinds="exception", limit=200)
    assert first["next_cursor"] is not None  # the run's exceptions take more than one page
    assert evidence_id not in {e["event_id"] for e in first["items"]}  # the crash is on a later page
    browser.get(server.http_url + "/ui/")
    browser.execute_script(f"localStorage.setItem('trainguard.readToken', '{server.tokens['read']}')")
    browser.get(server.http_url + f"/ui/#/incidents/{incident['incident_id']}")
    loaded(browser, "#/incidents/")
    text = WebDriverWait(browser, 30).until(lambda d: d.execute_script(
        "const t = document.getElementById('incident-traceback'); return t && t.textContent"))
    assert "mat1 and mat2" in text and "handled 0" not in text, text[:200]  # was: the first handled one
    rows = [r.text for r in browser.find_elements(By.CSS_SELECTOR, "#incident-frames tr.in-app")]
    assert len(rows) == 1 and f"step_{HANDLED}" in rows[0]
