"""The dashboard in a real browser (issue 6): headless Chromium (Debian's package, driven through its
chromedriver by Selenium) against a real ``trainguard serve`` fed by real torch trainings instrumented with
the SDK -- one whose learning rate blows the loss up, one that crashes on a malformed batch. The walk: give
the read token, load the runs list, open the run, see its plots drawn with data points and the incident
marked at its onset, click through to the incident and its evidence (plotted), search for the traceback.

With ``TRAINGUARD_SCREENSHOTS=<dir>`` the pages are also saved there (docs/screenshots/ comes from this).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Tuple

from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.services.e2e.serve_process import ServeProcess
from tests.support.browser import shows

WAIT_S = 30
POINTS_JS = """
const el = document.querySelector(arguments[0]);
const c = el && window.echarts && echarts.getInstanceByDom(el);
if (!c) return [0, 0];
const o = c.getOption();
const points = o.series.reduce((n, s) => n + s.data.filter(p => Number.isFinite(p[1])).length, 0);
const marks = o.series.reduce((n, s) => n + ((s.markLine && s.markLine.data) || []).length, 0);
return [points, marks];
"""


def shot(driver: Any, name: str) -> None:
    folder = os.environ.get("TRAINGUARD_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(folder) / f"{name}.png"))


def loaded(driver: Any, hash_prefix: str) -> Any:
    return WebDriverWait(driver, WAIT_S).until(
        lambda d: (d.find_element(By.ID, "view").get_attribute("data-loaded") or "").startswith(hash_prefix))


def test_runs_run_plots_incident_and_search(fed: Tuple[ServeProcess, str, str], browser: Any) -> None:
    server, diverging, crashing = fed
    browser.get(server.http_url + "/ui/")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.ID, "token").is_displayed())
    browser.find_element(By.ID, "token").send_keys(server.tokens["read"])
    browser.find_element(By.ID, "login-submit").click()

    loaded(browser, "#/runs")
    rows = browser.find_elements(By.CSS_SELECTOR, "table#runs tbody tr")
    assert {diverging, crashing} <= {r.find_element(By.CSS_SELECTOR, ".muted").text for r in rows}
    shot(browser, "runs")
    tag = browser.find_element(By.ID, "tag")  # filtering by a tag no run has: the list empties
    tag.send_keys("no-such-tag=1")
    tag.submit()
    loaded(browser, "#/runs?tag=")
    WebDriverWait(browser, WAIT_S).until(lambda d: not d.find_elements(By.CSS_SELECTOR, "table#runs tbody tr"))
    browser.get(server.http_url + "/ui/#/runs")
    WebDriverWait(browser, WAIT_S).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, f"a.run-link[href='#/runs/{diverging}']"))

    browser.find_element(By.CSS_SELECTOR, f"a.run-link[href='#/runs/{diverging}']").click()
    loaded(browser, f"#/runs/{diverging}")
    loss = "[data-metric='loss']"
    points, marks = WebDriverWait(browser, WAIT_S).until(
        lambda d: (r := d.execute_script(POINTS_JS, loss)) and r[0] > 0 and r)
    assert points >= 20 and marks >= 1  # the loss plotted, the explosion marked at its onset
    grad_points, _ = browser.execute_script(POINTS_JS, "[data-metric='grad/global_norm']")
    assert grad_points > 0
    shot(browser, "run")

    links = browser.find_elements(By.CSS_SELECTOR, "a.incident-link")
    assert links and "explosion" in links[0].text.lower()
    links[0].click()
    loaded(browser, "#/incidents/")
    assert "explosion" in browser.find_element(By.ID, "incident-title").text.lower()
    assert browser.find_elements(By.CSS_SELECTOR, "#evidence li")
    assert browser.find_elements(By.CSS_SELECTOR, "#checks li")
    evidence_points, onset = WebDriverWait(browser, WAIT_S).until(
        lambda d: (r := d.execute_script(POINTS_JS, "#evidence-chart")) and r[0] > 0 and r)
    assert evidence_points > 0 and onset == 1
    shot(browser, "incident")

    box = browser.find_element(By.ID, "search-box")
    box.send_keys("mat1 and mat2")
    box.submit()
    loaded(browser, "#/search")
    hits = WebDriverWait(browser, WAIT_S).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#hits li"))
    assert any(crashing in h.text and "RuntimeError" in h.text for h in hits)
    shot(browser, "search")

    browser.get(server.http_url + "/ui/#/clusters")
    loaded(browser, "#/clusters")
    link = [a for a in browser.find_elements(By.CSS_SELECTOR, "a.cluster-link") if a.text == "RuntimeError"]
    assert link, [a.text for a in browser.find_elements(By.CSS_SELECTOR, "a.cluster-link")]
    link[0].click()
    loaded(browser, "#/clusters/")
    assert browser.find_element(By.ID, "cluster-title").text == "RuntimeError"
    assert crashing in browser.find_element(By.CSS_SELECTOR, "main .kv").text  # the affected run
    app_frames = browser.find_elements(By.CSS_SELECTOR, "#frames tr.in-app")
    assert app_frames and any("trainings" in f.text for f in app_frames)  # the training's own frame, marked
    assert "mat1 and mat2" in browser.find_element(By.ID, "sample-traceback").text
    shot(browser, "cluster")


def test_per_layer_gradient_norms_are_a_heatmap(fed: Tuple[ServeProcess, str, str], browser: Any) -> None:
    server, diverging, _ = fed
    layers = [s["name"] for s in server.get(f"/api/v1/runs/{diverging}/metrics/summary")
              if s["name"].startswith("grad/layer/")]
    assert layers  # watch() reported them
    browser.get(server.http_url + f"/ui/#/runs/{diverging}")
    loaded(browser, f"#/runs/{diverging}")
    cells = WebDriverWait(browser, WAIT_S).until(lambda d: d.execute_script(
        "const el = document.getElementById('layer-heatmap'); const c = el && echarts.getInstanceByDom(el);"
        "return c ? c.getOption().series[0].data.length : 0;"))
    rows = browser.execute_script(
        "return echarts.getInstanceByDom(document.getElementById('layer-heatmap')).getOption().yAxis[0].data.length;")
    assert cells > 0 and rows == min(len(layers), 48)


def test_a_wrong_token_is_refused_and_asked_again(fed: Tuple[ServeProcess, str, str], browser: Any) -> None:
    server, _, _ = fed
    browser.get(server.http_url + "/ui/#/runs")
    browser.execute_script("localStorage.setItem('trainguard.readToken', 'tg_read_not-a-real-token'); location.reload();")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.ID, "token").is_displayed())
    assert browser.find_element(By.ID, "login-error").text  # the API's 401 message, shown
    assert not browser.find_elements(By.CSS_SELECTOR, "table#runs tbody tr")


def test_incident_workflow_in_the_page(fed: Tuple[ServeProcess, str, str], browser: Any) -> None:
    server, diverging, _ = fed
    (incident,) = [i for i in server.get(f"/api/v1/runs/{diverging}/incidents")["items"] if not i["explained_by"]]
    browser.get(server.http_url + "/ui/")
    browser.execute_script(f"localStorage.setItem('trainguard.readToken', '{server.tokens['read']}')")
    browser.get(server.http_url + f"/ui/#/incidents/{incident['incident_id']}")
    loaded(browser, "#/incidents/")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.ID, "wf-name"))
    assert "Nobody" in browser.find_element(By.ID, "workflow-state").text
    browser.find_element(By.ID, "wf-name").send_keys("ana")
    browser.find_element(By.ID, "wf-ack").click()
    shows(browser, "workflow-state", "Acknowledged by ana")
    browser.find_element(By.ID, "wf-note").send_keys("LR doubles every step from 40")
    browser.find_element(By.ID, "wf-add-note").click()
    shows(browser, "wf-notes", "LR doubles every step from 40")
    browser.find_element(By.ID, "wf-cause").send_keys("LR schedule multiplies instead of adds")
    browser.find_element(By.ID, "wf-resolve").click()
    shows(browser, "root-cause", "LR schedule multiplies instead of adds")
    stored = server.get(f"/api/v1/incidents/{incident['incident_id']}/workflow")["workflow"]
    assert (stored["acknowledged_by"], stored["resolved_by"], [n["text"] for n in stored["notes"]]) == (
        "ana", "ana", ["LR doubles every step from 40"])
    browser.find_element(By.ID, "wf-resolve").click()  # an empty root cause: the API's 422, shown
    shows(browser, "wf-error", "422")
