"""Resolve changes the status everywhere (issue 22): in headless Chromium against the package's real
``trainguard serve`` (conftest.py's ``fed``), a person resolves each standing incident of the crashed run on its
page; the incident page, the run page, the runs list and the API then all say ``resolved``, and the run's
health, ``critical`` while its crash was open, is ``healthy`` once nothing else is open."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.services.dashboard.test_dashboard_browser import loaded
from tests.services.dashboard.test_run_page_browser import WAIT_S, open_run
from tests.services.e2e.serve_process import ServeProcess
from tests.support.browser import shows

Fed = Tuple[ServeProcess, str, str]
RUN_ROW_JS = """
const a = document.querySelector(`a.run-link[href='#/runs/${arguments[0]}']`);
const cells = a ? a.closest('tr').querySelectorAll('td') : [];
return a ? {status: cells[1].textContent.trim(), health: cells[2].textContent.trim(),
            open: cells[4].textContent.trim()} : null;
"""


def standing(server: ServeProcess, run_id: str) -> List[Dict[str, Any]]:
    """The run's incidents a person would act on: not a consequence of another, not resolved."""
    return [i for i in server.get(f"/api/v1/runs/{run_id}/incidents")["items"]
            if not i["explained_by"] and i["status"] != "resolved"]


def run_row(browser: Any, server: ServeProcess, run_id: str) -> Dict[str, str]:
    browser.get(server.http_url + "/ui/#/runs")
    loaded(browser, "#/runs")
    row: Dict[str, str] = WebDriverWait(browser, WAIT_S).until(lambda d: d.execute_script(RUN_ROW_JS, run_id))
    return row


def test_resolve_changes_the_status_everywhere_and_the_run_health_follows(fed: Fed, browser: Any) -> None:
    server, _, crashing = fed
    todo = standing(server, crashing)
    run = server.get(f"/api/v1/runs/{crashing}")
    assert todo and run["health"] == "critical" and run["open_incidents"] >= len(todo)
    open_run(browser, server, crashing)
    assert run_row(browser, server, crashing)["health"] == "critical"

    for incident in todo:
        iid = incident["incident_id"]
        browser.get(server.http_url + f"/ui/#/incidents/{iid}")
        loaded(browser, "#/incidents/")
        assert browser.find_element(By.ID, "incident-status").text == incident["status"]  # open or ongoing
        WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.ID, "wf-name"))
        browser.find_element(By.ID, "wf-name").send_keys("ana")
        browser.find_element(By.ID, "wf-cause").send_keys("the batch had the wrong feature width")
        browser.find_element(By.ID, "wf-resolve").click()
        shows(browser, "root-cause", "the batch had the wrong feature width")
        shows(browser, "incident-status", "resolved")  # the page's own status, without a reload
        shown = server.get(f"/api/v1/incidents/{iid}")
        assert shown["status"] == "resolved" and shown["resolved_ns"] > 0
        browser.refresh()
        loaded(browser, "#/incidents/")
        assert browser.find_element(By.ID, "incident-status").text == "resolved"

    # the API: the run, its incident list, the project's lists by status
    run = server.get(f"/api/v1/runs/{crashing}")
    assert (run["health"], run["open_incidents"]) == ("healthy", 0)
    ids = {i["incident_id"] for i in todo}
    assert {i["incident_id"]: i["status"] for i in server.get(f"/api/v1/runs/{crashing}/incidents")["items"]
            if i["incident_id"] in ids} == dict.fromkeys(ids, "resolved")
    assert not ids & {i["incident_id"] for i in server.pages("/api/v1/incidents", status="open")}
    assert not ids & {i["incident_id"] for i in server.pages("/api/v1/incidents", status="ongoing")}
    assert ids <= {i["incident_id"] for i in server.pages("/api/v1/incidents", status="resolved")}
    listed = {r["run_id"]: r for r in server.get("/api/v1/runs")["items"]}[crashing]
    assert (listed["health"], listed["open_incidents"]) == ("healthy", 0)

    # the run page: its header and its incident table
    open_run(browser, server, crashing)
    header = browser.find_element(By.ID, "run-header").text
    assert "healthy" in header and "critical" not in header
    statuses = [r.find_elements(By.CSS_SELECTOR, "td")[2].text
                for r in browser.find_elements(By.CSS_SELECTOR, "#incidents tbody tr")]
    assert statuses and set(statuses) == {"resolved"}

    # the runs list
    assert run_row(browser, server, crashing) == {"status": run["status"], "health": "healthy", "open": "0"}
