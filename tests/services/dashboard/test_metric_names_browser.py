"""The dashboard names metrics in ``?names=`` with the API's escapes (docs/security.md H35): a metric whose name
holds a comma or a space at an end (legal) is asked for as itself. Before, the dashboard joined names with
bare commas, so ``a,b`` was asked for as ``a`` and ``b`` and its chart stayed empty. Headless Chromium against
the package's real ``trainguard serve`` (conftest.py's ``fed``): the page's own ``namesParam`` and ``api``."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from typing import Any, Tuple

from tests.services.dashboard.test_dashboard_browser import loaded
from tests.services.e2e.serve_process import ServeProcess
from tests.support.waiting import poll

NAMES = ["a,b", "a", "b", " x", "y ", "c\\", "loss\\x1b[2J", "plain"]
FETCH_JS = """
const done = arguments[arguments.length - 1];
api(`/api/v1/runs/${encodeURIComponent(arguments[0])}/metrics?names=${namesParam(arguments[1])}`)
  .then(d => done(Object.keys(d.series).filter(k => Object.keys(d.series[k]).length).sort()))
  .catch(e => done('error: ' + e.message));
"""


def test_the_dashboard_asks_for_names_with_commas_and_edge_spaces_as_themselves(
        fed: Tuple[ServeProcess, str, str], browser: Any) -> None:
    server, _, _ = fed
    run_id = f"names-{uuid.uuid4().hex[:6]}"
    events = [{"event_id": uuid.uuid4().hex, "run_id": run_id, "step": step, "time_unix_nano": time.time_ns(),
               "metrics": {"points": [{"name": n, "value": float(k)} for k, n in enumerate(NAMES)]}}
              for step in range(3)]
    req = urllib.request.Request(server.http_url + "/v1/ingest", data=json.dumps({"events": events}).encode(),
                                 headers={"Authorization": f"Bearer {server.tokens['ingest']}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert json.loads(resp.read())["accepted"] == 3
    assert poll(lambda: len(server.get(f"/api/v1/runs/{run_id}/metrics")["series"]) == len(NAMES), timeout=30)
    browser.get(server.http_url + "/ui/")
    browser.execute_script(f"localStorage.setItem('trainguard.readToken', '{server.tokens['read']}')")
    browser.get(server.http_url + "/ui/#/runs")
    loaded(browser, "#/runs")
    browser.set_script_timeout(30)
    for asked in (["a,b"], [" x", "y "], ["c\\", "loss\\x1b[2J", "plain"], ["a", "b"]):
        got = browser.execute_async_script(FETCH_JS, run_id, asked)
        assert got == sorted(asked), (asked, got)  # ["a,b"] was read as "a" and "b"
