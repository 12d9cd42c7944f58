"""The run page's wall-time x axis (issue 22), in headless Chromium against the package's real ``trainguard
serve`` fed by real SDK-instrumented trainings (conftest.py's ``fed``): with *X axis: wall time* every chart's x
is the time since the run's first step, summed from the run's own ``time/step_s`` (boundary to boundary), for
the run, an overlaid run (on its own clock: relative time) and the incident's onset; *step* puts them back."""

from __future__ import annotations

import bisect
from typing import Any, Callable, Dict, List, Tuple

from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.services.dashboard.test_dashboard_browser import loaded, shot
from tests.services.dashboard.test_run_page_browser import WAIT_S, open_run, series
from tests.services.e2e.serve_process import ServeProcess

Fed = Tuple[ServeProcess, str, str]
AXIS_JS = """const c = echarts.getInstanceByDom(document.querySelector("#cards .chart[data-metric='loss']"));
return c ? c.getOption().xAxis[0].name : null;"""
MARKS_JS = """const c = echarts.getInstanceByDom(document.querySelector("#cards .chart[data-metric='loss']"));
return c.getOption().series.flatMap(s => ((s.markLine || {}).data || []).map(m => m.xAxis));"""


def clock(server: ServeProcess, run_id: str) -> Callable[[int], float]:
    """The page's rule, from the API's rank-0 ``time/step_s`` buckets: seconds since the step before the first
    timed one, a bucket adding mean x its finite count, linear between bucket ends, flat outside."""
    buckets = server.get(f"/api/v1/runs/{run_id}/metrics", names="time/step_s",
                         max_points=600)["series"]["time/step_s"]["0"]
    knots: List[Tuple[int, float]] = [(buckets[0]["step_start"] - 1, 0.0)]
    total = 0.0
    for b in buckets:
        total += b["mean"] * (b["count"] - b["nonfinite"])
        knots.append((b["step_end"], total))
    steps = [k[0] for k in knots]

    def at(step: int) -> float:
        if step <= steps[0]:
            return 0.0
        if step >= steps[-1]:
            return knots[-1][1]
        hi = bisect.bisect_right(steps, step)
        (s0, t0), (s1, t1) = knots[hi - 1], knots[hi]
        return t0 + (t1 - t0) * (step - s0) / (s1 - s0)
    return at


def loss_steps(server: ServeProcess, run_id: str) -> List[int]:
    buckets = server.get(f"/api/v1/runs/{run_id}/metrics", names="loss", max_points=600)["series"]["loss"]["0"]
    return [b["step_end"] for b in buckets]


def close(got: List[float], expected: List[float]) -> bool:
    return len(got) == len(expected) and all(abs(g - e) <= 1e-9 * max(1.0, abs(e)) for g, e in zip(got, expected))


def drawn_x(browser: Any, name: str = "raw:rank 0") -> List[float]:
    by_id: Dict[str, Any] = {s["id"]: s for s in series(browser, "loss")}
    return [p[0] for p in by_id[name]["data"]]


def test_the_charts_x_axis_switches_to_wall_time_and_back(fed: Fed, browser: Any) -> None:
    server, diverging, crashing = fed
    at = clock(server, diverging)
    steps = loss_steps(server, diverging)
    assert at(steps[-1]) > 0.5 and len(steps) >= 20  # a real run's clock: seconds of training

    open_run(browser, server, diverging)
    assert browser.execute_script(AXIS_JS) == "step" and drawn_x(browser) == steps
    Select(browser.find_element(By.ID, "x-axis")).select_by_value("time")
    loaded(browser, f"#/runs/{diverging}?x=time")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.ID, "view").get_attribute("data-charts"))
    assert browser.execute_script(AXIS_JS) == "wall time"
    x = drawn_x(browser)
    assert close(x, [at(s) for s in steps]) and x == sorted(x) and x[-1] > x[0]
    (explosion,) = [i for i in server.get(f"/api/v1/runs/{diverging}/incidents")["items"]
                    if i["first_step"] >= 0 and not i["explained_by"]]
    assert close(browser.execute_script(MARKS_JS), [at(explosion["first_step"])])  # its onset, in time
    zoomed = browser.execute_script(  # the one zoom still moves every chart on the time axis
        "return [...document.querySelectorAll('#cards .chart')].map(el => echarts.getInstanceByDom(el)"
        ".getOption().xAxis[0].name);")
    assert set(zoomed) == {"wall time"}
    shot(browser, "run-wall-time")

    # another run overlaid: on its own clock (relative time), not on the first run's steps
    Select(browser.find_element(By.ID, "overlay")).select_by_value(crashing)
    loaded(browser, f"#/runs/{diverging}?x=time&overlay={crashing}")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.ID, "view").get_attribute("data-charts"))
    theirs = clock(server, crashing)
    other = {s["name"]: s for s in series(browser, "loss")}["demo-crashing · rank 0"]
    assert close([p[0] for p in other["data"]], [theirs(s) for s in loss_steps(server, crashing)])

    Select(browser.find_element(By.ID, "x-axis")).select_by_value("")  # back to steps
    loaded(browser, f"#/runs/{diverging}?overlay={crashing}")
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.ID, "view").get_attribute("data-charts"))
    assert browser.execute_script(AXIS_JS) == "step"
    assert drawn_x(browser, "raw:demo-diverging · rank 0") == steps
