"""The run page as an engineer watches and debugs a run (issue 22), in headless Chromium against the package's
real ``trainguard serve`` fed by two real SDK-instrumented trainings (conftest.py's ``fed``): TensorBoard-style
smoothing over the raw line, the metric picker, one zoom for every chart, another run overlaid, the
hyperparameters and their diff, dark mode, and the crash incident's traceback."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.services.dashboard.conftest import HEALTHY
from tests.services.dashboard.test_dashboard_browser import loaded, shot
from tests.services.e2e.serve_process import ServeProcess

WAIT_S = 30
SERIES_JS = """
const el = document.querySelector(arguments[0]);
const c = el && window.echarts && echarts.getInstanceByDom(el);
if (!c) return null;
return c.getOption().series.map(s => ({id: s.id, name: s.name, data: s.data,
                                        dashed: (s.lineStyle || {}).type === 'dashed'}));
"""
ZOOM_JS = """
return [...document.querySelectorAll('#cards .chart')].map(el => {
  const z = echarts.getInstanceByDom(el).getOption().dataZoom[0]; return [z.start, z.end]; });
"""
CARDS_JS = "return [...document.querySelectorAll('#cards .chart')].map(el => el.dataset.metric);"
Fed = Tuple[ServeProcess, str, str]


def open_run(browser: Any, server: ServeProcess, run_id: str, query: str = "") -> None:
    browser.get(server.http_url + "/ui/")
    browser.execute_script(f"localStorage.setItem('trainguard.readToken', '{server.tokens['read']}')")
    browser.get(server.http_url + "/ui/#/runs")
    loaded(browser, "#/runs")
    browser.get(server.http_url + f"/ui/#/runs/{run_id}{query}")
    loaded(browser, f"#/runs/{run_id}")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.ID, "view").get_attribute("data-charts"))


def series(browser: Any, metric: str) -> List[Dict[str, Any]]:
    return WebDriverWait(browser, WAIT_S).until(lambda d: d.execute_script(SERIES_JS, f"[data-metric='{metric}']"))


def loss_points(server: ServeProcess, run_id: str) -> List[List[float]]:
    """The run's loss as the API serves it (rank 0, bucket maxima, finite points)."""
    buckets = server.get(f"/api/v1/runs/{run_id}/metrics?names=loss&max_points=600")["series"]["loss"]["0"]
    return [[b["step_end"], b["max"]] for b in buckets if isinstance(b["max"], float)]


def test_smoothing_is_tensorboards_ema_over_the_raw_line_and_is_remembered(fed: Fed, browser: Any) -> None:
    server, diverging, _ = fed
    open_run(browser, server, diverging)
    (raw,) = series(browser, "loss")
    assert raw["id"] == "raw:rank 0"  # smoothing 0: the raw line alone
    browser.execute_script("const s = document.getElementById('smoothing'); s.value = '0.6';"
                           "s.dispatchEvent(new Event('input'));")
    drawn = {s["id"]: s for s in series(browser, "loss")}
    assert set(drawn) == {"raw:rank 0", "smooth:rank 0"}
    points = [p for p in drawn["raw:rank 0"]["data"] if isinstance(p[1], (int, float))]
    assert points == loss_points(server, diverging)[:len(points)] and len(points) >= 20
    last, expected = 0.0, []
    for n, (_, y) in enumerate(points[:40], 1):  # TensorBoard: debiased EMA, weight 0.6
        last = last * 0.6 + 0.4 * y
        expected.append(last / (1 - 0.6 ** n))
    smoothed = [p[1] for p in drawn["smooth:rank 0"]["data"][:40]]
    assert smoothed == [round_like(e, s) for e, s in zip(expected, smoothed)]
    assert smoothed != [p[1] for p in points[:40]]
    shot(browser, "run-smoothed")
    browser.refresh()  # remembered in this browser
    loaded(browser, f"#/runs/{diverging}")
    assert browser.find_element(By.ID, "smoothing").get_attribute("value") == "0.6"
    assert "smooth:rank 0" in {s["id"] for s in series(browser, "loss")}
    browser.execute_script("localStorage.removeItem('trainguard.smoothing')")


def round_like(expected: float, got: float) -> float:
    """``got`` when it equals ``expected`` to 1e-9 relative (JS and Python float sums), else ``expected``."""
    return got if abs(got - expected) <= 1e-9 * max(1.0, abs(expected)) else expected


def test_metric_picker_and_one_zoom_for_every_chart(fed: Fed, browser: Any) -> None:
    server, diverging, _ = fed
    open_run(browser, server, diverging)
    names = [s["name"] for s in server.get(f"/api/v1/runs/{diverging}/metrics/summary")]
    browser.execute_script("document.getElementById('picker').open = true")
    browser.execute_script("const s = document.getElementById('metric-search'); s.value = 'mem/';"
                           "s.dispatchEvent(new Event('input'));")
    visible = [el.get_attribute("data-name") for el in browser.find_elements(By.CSS_SELECTOR, "#metric-list .metric-option")
               if el.is_displayed()]
    assert visible == sorted(n for n in names if "mem/" in n) and visible
    browser.execute_script("document.getElementById('metric-show-matching').click()")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.execute_script(CARDS_JS) == visible)
    assert series(browser, visible[0])[0]["data"]  # drawn with its points
    browser.execute_script("document.getElementById('metric-defaults').click()")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#cards [data-metric='loss']"))
    tick = "document.querySelector(\"#metric-list input[value='loss']\").click()"
    browser.execute_script(tick)  # unticked: its chart goes
    WebDriverWait(browser, WAIT_S).until(lambda d: not d.find_elements(By.CSS_SELECTOR, "#cards [data-metric='loss']"))
    browser.execute_script(tick)
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#cards [data-metric='loss']"))

    charts = browser.find_elements(By.CSS_SELECTOR, "#cards .chart")
    assert len(charts) >= 3
    assert browser.execute_script(ZOOM_JS) == [[0, 100]] * len(charts)
    browser.execute_script("echarts.getInstanceByDom(document.querySelectorAll('#cards .chart')[1])"
                           ".dispatchAction({type: 'dataZoom', start: 20, end: 60});")
    assert browser.execute_script(ZOOM_JS) == [[20, 60]] * len(charts)  # one zoom moved every chart
    browser.execute_script("document.getElementById('zoom-reset').click()")
    assert browser.execute_script(ZOOM_JS) == [[0, 100]] * len(charts)


def test_another_run_overlaid_dashed_with_its_hyperparameters_diffed(fed: Fed, browser: Any) -> None:
    server, diverging, crashing = fed
    open_run(browser, server, diverging)

    Select(browser.find_element(By.ID, "overlay")).select_by_value(crashing)
    loaded(browser, f"#/runs/{diverging}?overlay={crashing}")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.ID, "view").get_attribute("data-charts"))
    drawn = {s["name"]: s for s in series(browser, "loss")}
    assert set(drawn) == {"demo-diverging · rank 0", "demo-crashing · rank 0"}  # the legend says which run
    other = drawn["demo-crashing · rank 0"]
    assert other["dashed"] and not drawn["demo-diverging · rank 0"]["dashed"]
    assert [p for p in other["data"] if isinstance(p[1], (int, float))] == loss_points(server, crashing)
    rows = {r.get_attribute("data-key"): r for r in browser.find_elements(By.CSS_SELECTOR, "#hparams tbody tr")}
    tags = server.get(f"/api/v1/runs/{diverging}")["tags"]
    assert {f"tag {k}" for k in tags} <= set(rows) and "torch" in rows
    kind = rows["tag kind"]
    assert "differs" in kind.get_attribute("class") and kind.text.split()[2:] == ["diverging", "crashing"]
    assert "differs" not in rows["torch"].get_attribute("class")  # the same torch: not flagged
    assert browser.find_element(By.ID, "hparam-diff-count").text.startswith("2 of")  # kind and argv
    shot(browser, "run-overlay")

    Select(browser.find_element(By.ID, "overlay")).select_by_value(HEALTHY)  # a third run
    loaded(browser, f"#/runs/{diverging}?overlay={crashing}%2C{HEALTHY}")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.ID, "view").get_attribute("data-charts"))
    assert {s["name"] for s in series(browser, "loss")} == {
        "demo-diverging · rank 0", "demo-crashing · rank 0", "demo-healthy · rank 0"}
    kind = browser.find_element(By.CSS_SELECTOR, "#hparams tr[data-key='tag kind']")
    assert kind.text.split()[2:] == ["diverging", "crashing", "healthy"]
    browser.execute_script(f"document.querySelector(\".remove-overlay[data-run='{crashing}']\").click()")
    loaded(browser, f"#/runs/{diverging}?overlay={HEALTHY}")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.ID, "view").get_attribute("data-charts"))
    assert {s["name"] for s in series(browser, "loss")} == {"demo-diverging · rank 0", "demo-healthy · rank 0"}
    Select(browser.find_element(By.ID, "legend-by")).select_by_value("kind")  # runs named by a tag
    loaded(browser, f"#/runs/{diverging}?overlay={HEALTHY}&legend=kind")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.ID, "view").get_attribute("data-charts"))
    assert {s["name"] for s in series(browser, "loss")} == {"kind=diverging · rank 0", "kind=healthy · rank 0"}


DARK_CHART_JS = "return echarts.getInstanceByDom(document.querySelector('#cards .chart')).getOption().darkMode"


def background(browser: Any) -> str:
    return str(browser.execute_script("return getComputedStyle(document.body).backgroundColor"))


def test_dark_mode_follows_the_system_and_the_toggle_is_remembered(fed: Fed, browser: Any) -> None:
    server, diverging, _ = fed
    try:
        browser.execute_cdp_cmd("Emulation.setEmulatedMedia",
                                {"features": [{"name": "prefers-color-scheme", "value": "light"}]})
        open_run(browser, server, diverging)
        browser.execute_script("localStorage.removeItem('trainguard.theme'); location.reload()")
        loaded(browser, f"#/runs/{diverging}")
        light = background(browser)
        assert browser.execute_script("return document.documentElement.dataset.theme") == "light"
        browser.execute_cdp_cmd("Emulation.setEmulatedMedia",
                                {"features": [{"name": "prefers-color-scheme", "value": "dark"}]})
        WebDriverWait(browser, WAIT_S).until(lambda d: background(d) != light)  # the system's setting, followed
        dark = background(browser)
        assert sum(int(c) for c in dark[dark.index("(") + 1:-1].split(",")[:3]) < 150  # dark indeed
        WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.ID, "view").get_attribute("data-charts"))
        assert browser.execute_script(DARK_CHART_JS) is True  # the charts redrawn in echarts' dark theme
        shot(browser, "run-dark")
        browser.find_element(By.ID, "theme-toggle").click()  # the user's choice beats the system's
        WebDriverWait(browser, WAIT_S).until(lambda d: background(d) == light)
        browser.refresh()
        loaded(browser, f"#/runs/{diverging}")
        assert background(browser) == light and browser.find_element(By.ID, "theme-toggle").text == "Dark"
        WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.ID, "view").get_attribute("data-charts"))
        assert browser.execute_script(DARK_CHART_JS) is not True
    finally:
        browser.execute_script("localStorage.removeItem('trainguard.theme')")
        browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})


def test_the_crash_incident_shows_its_traceback(fed: Fed, browser: Any) -> None:
    server, _, crashing = fed
    (incident,) = [i for i in server.get(f"/api/v1/runs/{crashing}/incidents")["items"]
                   if (i["category"], i["subtype"]) == ("process", "exception")]
    (event,) = server.get(f"/api/v1/runs/{crashing}/events?kinds=exception")["items"]
    frames = event["payload"]["exception"]["frames"]
    innermost_app = [f for f in frames if f.get("in_app")][-1]
    open_run(browser, server, crashing)
    browser.get(server.http_url + f"/ui/#/incidents/{incident['incident_id']}")
    loaded(browser, "#/incidents/")
    text = WebDriverWait(browser, WAIT_S).until(lambda d: d.execute_script(
        "const t = document.getElementById('incident-traceback'); return t && t.textContent"))
    assert "mat1 and mat2" in text and f"in {innermost_app['function']}" in text
    rows = browser.find_elements(By.CSS_SELECTOR, "#incident-frames tbody tr")
    assert len(rows) == len(frames)
    app_rows = [r.text for r in browser.find_elements(By.CSS_SELECTOR, "#incident-frames tr.in-app")]
    assert len(app_rows) == sum(1 for f in frames if f.get("in_app"))
    assert innermost_app["function"] in app_rows[-1] and f":{innermost_app['lineno']}" in app_rows[-1]
    shot(browser, "incident-traceback")


def test_each_chart_switches_between_log_and_linear(fed: Fed, browser: Any) -> None:
    server, diverging, _ = fed
    open_run(browser, server, diverging)
    axis = "return echarts.getInstanceByDom(document.querySelector(\"#cards .chart[data-metric='loss']\")).getOption().yAxis[0].type"
    assert browser.execute_script(axis) == "log"  # the explosion spans > 1e3: log by default
    other = "return echarts.getInstanceByDom(document.querySelector(\"#cards .chart[data-metric='opt/lr']\")).getOption().yAxis[0].type"
    before = browser.execute_script(other)
    browser.execute_script("document.querySelector(\"#cards .scale-toggle[data-scale-for='loss']\").click()")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.execute_script(axis) == "value")
    assert browser.execute_script(other) == before  # that chart only
    browser.execute_script("document.querySelector(\"#cards .scale-toggle[data-scale-for='loss']\").click()")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.execute_script(axis) == "log")


def test_a_downsampled_series_is_its_mean_in_a_min_max_band(fed: Fed, browser: Any) -> None:
    server, diverging, _ = fed
    open_run(browser, server, diverging, "?points=8")  # 56 steps in 8 buckets
    buckets = server.get(f"/api/v1/runs/{diverging}/metrics?names=grad/global_norm&max_points=8"
                         )["series"]["grad/global_norm"]["0"]
    assert any(b["count"] > 1 for b in buckets)
    drawn = {s["id"]: s["data"] for s in series(browser, "grad/global_norm")}
    assert set(drawn) == {"raw:rank 0", "band-low:rank 0", "band-high:rank 0"}
    assert drawn["raw:rank 0"] == [[b["step_end"], b["mean"]] for b in buckets]
    assert drawn["band-low:rank 0"] == [[b["step_end"], b["min"]] for b in buckets]
    highs = [p[1] for p in drawn["band-high:rank 0"]]  # stacked on the low: max - min
    assert all(abs(h - (b["max"] - b["min"])) <= 1e-9 * max(1.0, b["max"]) for h, b in zip(highs, buckets))
    assert any(h > 0 for h in highs)


WIDER_JS = """return [...document.querySelectorAll('#view *')].filter(e => e.getBoundingClientRect().right > innerWidth + 1)
  .map(e => e.tagName + '#' + e.id).slice(0, 5);"""


def test_the_run_and_crash_pages_fit_a_760_px_window(fed: Fed, browser: Any) -> None:
    server, diverging, crashing = fed
    (incident,) = [i for i in server.get(f"/api/v1/runs/{crashing}/incidents")["items"]
                   if (i["category"], i["subtype"]) == ("process", "exception")]
    browser.set_window_size(760, 1000)
    try:
        open_run(browser, server, diverging, f"?overlay={crashing}")  # long argv in the hyperparameters
        assert browser.execute_script("return innerWidth") <= 760
        assert browser.execute_script(WIDER_JS) == []
        browser.get(server.http_url + f"/ui/#/incidents/{incident['incident_id']}")  # long frame paths
        loaded(browser, "#/incidents/")
        WebDriverWait(browser, WAIT_S).until(lambda d: d.find_elements(By.ID, "incident-traceback"))
        assert browser.execute_script(WIDER_JS) == []
    finally:
        browser.set_window_size(1400, 1000)
