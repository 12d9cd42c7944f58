"""Per-rank step time on the dashboard (issue 23), in headless Chromium against the package's real ``trainguard
serve`` (conftest.py's ``fed``) into which a recorded real straggler run is sent through the HTTP ingest: four
ranks of ``torchrun tests/fixtures/straggler/job.py`` (gloo, CPU), rank 2 made 2.5x slower in compute from step 30
(tests/fixtures/straggler/compute.jsonl.gz, as the SDKs wrote it). The run page's heatmap draws every rank's
own work per step (data + forward + optimizer) as the API's series give it, the straggler's row marked; the
straggler incident's page shows its rank against the others -- each rank's median over the incident's steps
and its ratio to the other ranks'."""

from __future__ import annotations

import gzip
import json
import statistics
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.services.dashboard.test_dashboard_browser import loaded, shot
from tests.services.dashboard.test_run_page_browser import WAIT_S, WIDER_JS, open_run
from tests.services.e2e.serve_process import ServeProcess
from tests.support.waiting import poll
from trainguard_engine.catalogue import DetectionSettings

RECORDED = Path(__file__).resolve().parents[2] / "fixtures" / "straggler" / "compute.jsonl.gz"
OWN = ["time/data_s", "time/forward_s", "time/optimizer_s"]
HEATMAP_JS = """const el = document.getElementById('rank-heatmap'); const c = el && echarts.getInstanceByDom(el);
if (!c || el.dataset.measure !== arguments[0]) return null;
const o = c.getOption(); return {rows: o.yAxis[0].data, steps: o.xAxis[0].data, cells: o.series[0].data};"""
Straggler = Tuple[ServeProcess, str, Dict[str, Any], Dict[str, str]]


@pytest.fixture(scope="module")
def straggler(fed: Tuple[ServeProcess, str, str]) -> Iterator[Straggler]:
    """The recorded run sent to the server (the ingest token's project), processed to its straggler incident."""
    server = fed[0]
    with gzip.open(RECORDED, "rt", encoding="utf-8") as fh:
        events = [json.loads(line) for line in fh if line.strip()]
    for event in events:
        event["project"] = ""  # the token's project
    body = json.dumps({"events": events}).encode()
    request = urllib.request.Request(server.http_url + "/v1/ingest", data=body, headers={
        "Authorization": f"Bearer {server.tokens['ingest']}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        answer = json.loads(resp.read())
    assert answer["accepted"] == len(events) and not answer["rejected"], answer
    run_id = events[0]["run_id"]
    tags = next(e["lifecycle"]["tags"] for e in events if e.get("lifecycle", {}).get("phase") == "START")

    def found() -> Any:
        run = server.get_or_none(f"/api/v1/runs/{run_id}")
        if not run or run["status"] == "running":
            return None
        return [i for i in server.get(f"/api/v1/runs/{run_id}/incidents")["items"]
                if (i["category"], i["subtype"]) == ("perf", "straggler") and not i["explained_by"]]
    (incident,) = poll(found, 60) or [None]
    assert incident is not None
    yield server, run_id, incident, tags


def own_work(server: ServeProcess, run_id: str, names: List[str], measure: str, **query: Any
             ) -> Dict[int, List[Tuple[int, float]]]:
    """The page's rule from the API's buckets: per rank, at each step of the base series (forward for own
    work), the sum of the named series' bucket means there."""
    series = server.get(f"/api/v1/runs/{run_id}/metrics", names=",".join(names), **query)["series"]
    base = "time/forward_s" if measure == "own" else measure
    out: Dict[int, List[Tuple[int, float]]] = {}
    for rank, buckets in series[base].items():
        steps = {b["step_end"]: 0.0 for b in buckets}
        for name in OWN if measure == "own" else [measure]:
            for b in series.get(name, {}).get(rank, []):
                if b["step_end"] in steps and isinstance(b["mean"], float):
                    steps[b["step_end"]] += b["mean"]
        out[int(rank)] = sorted(steps.items())
    return out


def cells_of(per_rank: Dict[int, List[Tuple[int, float]]]) -> List[List[float]]:
    steps = sorted({s for points in per_rank.values() for s, _ in points})
    return [[steps.index(s), y, v * 1000] for y, r in enumerate(sorted(per_rank)) for s, v in per_rank[r]]


def heatmap(browser: Any, measure: str) -> Dict[str, Any]:
    drawn: Dict[str, Any] = WebDriverWait(browser, WAIT_S).until(lambda d: d.execute_script(HEATMAP_JS, measure))
    return drawn


def test_the_run_page_heatmap_shows_every_ranks_step_time_and_the_straggler(straggler: Straggler,
                                                                            browser: Any) -> None:
    server, run_id, incident, tags = straggler
    slow, from_step = int(tags["slow_rank"]), int(tags["from_step"])
    assert incident["lead_rank"] == slow
    run = server.get(f"/api/v1/runs/{run_id}")
    open_run(browser, server, run_id)
    query = {"start_step": 0, "end_step": run["last_step"], "max_points": 200}

    drawn = heatmap(browser, "own")  # the default: own work, where a straggler shows
    expected = own_work(server, run_id, OWN, "own", **query)
    assert sorted(expected) == [0, 1, 2, 3]
    assert drawn["rows"] == [f"rank {r}" + (" · straggler" if r == slow else "") for r in range(4)]
    assert drawn["cells"] == cells_of(expected) and len(drawn["cells"]) >= 4 * 60
    late = {r: statistics.median(v for s, v in points if s >= from_step) for r, points in expected.items()}
    others = statistics.median(v for r, v in late.items() if r != slow)
    assert late[slow] > DetectionSettings().straggler_ratio * others  # the slow rank's row is the dark one
    browser.execute_script("document.getElementById('rank-heatmap-title').scrollIntoView()")
    shot(browser, "run-rank-heatmap")

    # by step time every rank waits for the slowest: the rows look alike (why own work is the default)
    Select(browser.find_element(By.ID, "rank-heatmap-measure")).select_by_value("time/step_s")
    drawn = heatmap(browser, "time/step_s")
    by_step = own_work(server, run_id, ["time/step_s"], "time/step_s", **query)
    assert drawn["cells"] == cells_of(by_step)
    late = {r: statistics.median(v for s, v in points if s >= from_step) for r, points in by_step.items()}
    assert late[slow] < 1.2 * statistics.median(v for r, v in late.items() if r != slow)


def test_the_straggler_incident_shows_its_rank_against_the_others(straggler: Straggler, browser: Any) -> None:
    server, run_id, incident, tags = straggler
    open_run(browser, server, run_id)
    browser.get(server.http_url + f"/ui/#/incidents/{incident['incident_id']}")
    loaded(browser, "#/incidents/")
    rows = WebDriverWait(browser, WAIT_S).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#rank-compare tbody tr"))
    shown = {int(r.get_attribute("data-rank")): (float(r.get_attribute("data-median")),
                                                 float(r.get_attribute("data-ratio")), r.get_attribute("class"))
             for r in rows}

    first, last = incident["first_step"], max(incident["last_step"], incident["first_step"])
    per_rank = own_work(server, run_id, [*OWN, "time/step_s"], "own", start_step=max(0, first - 30),
                        end_step=last + 10, max_points=200)
    medians = {r: statistics.median(v for s, v in points if first <= s <= last) for r, points in per_rank.items()}
    ratios = {r: m / statistics.median(x for q, x in medians.items() if q != r) for r, m in medians.items()}
    assert sorted(shown) == sorted(medians) == [0, 1, 2, 3]
    for r, (median, ratio, _) in shown.items():
        assert abs(median - medians[r]) <= 1e-12 and abs(ratio - ratios[r]) <= 1e-9 * ratios[r]
    lead = incident["lead_rank"]
    assert lead == int(tags["slow_rank"]) and shown[lead][2] == "lead"
    assert max(ratios, key=lambda r: ratios[r]) == lead and ratios[lead] > DetectionSettings().straggler_ratio
    assert f"Rank {lead} against the other ranks" in browser.find_element(By.ID, "incident-ranks").text
    colours = browser.execute_script(
        "return echarts.getInstanceByDom(document.getElementById('rank-compare-chart')).getOption().series"
        ".map(s => [s.name, s.itemStyle.color]);")
    assert {n for n, c in colours if c == "#d92d20"} == {f"rank {lead}"} and len(colours) == 4
    browser.execute_script("document.getElementById('incident-ranks').scrollIntoView()")
    shot(browser, "incident-straggler")


def test_the_straggler_pages_fit_a_760_px_window(straggler: Straggler, browser: Any) -> None:
    server, run_id, incident, _ = straggler
    browser.set_window_size(760, 1000)
    try:
        open_run(browser, server, run_id)
        heatmap(browser, "own")
        assert browser.execute_script(WIDER_JS) == []
        browser.get(server.http_url + f"/ui/#/incidents/{incident['incident_id']}")
        loaded(browser, "#/incidents/")
        WebDriverWait(browser, WAIT_S).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#rank-compare tbody tr"))
        assert browser.execute_script(WIDER_JS) == []
    finally:
        browser.set_window_size(1400, 1000)
