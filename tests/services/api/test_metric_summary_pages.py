"""``GET /api/v1/runs/{run}/metrics/summary`` answers a page of names at a time: before, a run with 200,000
metric names was answered in one response of all of them. Now at most ``limit`` names (1,000 by default,
5,000 at most), sorted, and the ``X-Next-Cursor`` header (and a ``Link: rel="next"``) gives the next page;
the pages together are the whole summary, each name once. A real uvicorn server on 127.0.0.1 over SQLite
stores."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List
from urllib.parse import quote

import httpx
import pytest

from tests.services.api.live_server import PROJECT, LiveApi
from trainguard_server.storage.base import MetricPoint
from trainguard_server.storage.sqlite import METRICS_DB, SqliteMetricStore

NAMES = [f"grad/layer/block.{i:04d}" for i in range(2_345)]


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveApi]:
    root = tmp_path_factory.mktemp("summary")
    store = SqliteMetricStore(root / METRICS_DB, synchronous="OFF")
    store.put([MetricPoint(PROJECT, "run-1", r, n, s, s, float("nan") if (i, s) == (7, 2) else i + s + r)
               for i, n in enumerate(NAMES) for r in (0, 1) for s in range(3)])
    store.close()
    live = LiveApi(root)
    try:
        yield live
    finally:
        live.close()


def _get(api: LiveApi, **params: Any) -> httpx.Response:
    return httpx.get(f"{api.url}/api/v1/runs/run-1/metrics/summary", params=params, headers=api.headers(),
                     timeout=60)


def test_the_summary_comes_in_pages_that_add_up_to_the_whole(api: LiveApi) -> None:
    first = _get(api)
    assert first.status_code == 200
    assert len(first.json()) == 1000  # was 2,345 in one answer
    pages: List[List[Dict[str, Any]]] = [first.json()]
    cursor = first.headers["x-next-cursor"]
    assert first.headers["link"] == (f'</api/v1/runs/run-1/metrics/summary?limit=1000&cursor={cursor}>; '
                                     f'rel="next"')
    while cursor:
        r = _get(api, limit=1000, cursor=cursor)
        assert r.status_code == 200
        pages.append(r.json())
        cursor = r.headers.get("x-next-cursor", "")
    assert [len(p) for p in pages] == [1000, 1000, 345]
    assert "link" not in r.headers
    got = [item for page in pages for item in page]
    assert [s["name"] for s in got] == NAMES  # sorted, each name once
    whole = api.stores.metrics.summary(PROJECT, "run-1")
    assert got[7] == {"name": NAMES[7], "count": 6, "first_step": 0, "last_step": 2, "min": 7.0, "max": 9.0,
                      "last": "NaN", "nonfinite": 2}
    assert [(s["name"], s["count"], s["min"], s["max"]) for s in got] == \
        [(s.name, s.count, s.min, s.max) for s in whole]


def test_page_size_is_bounded_and_a_bad_cursor_is_named(api: LiveApi) -> None:
    assert len(_get(api, limit=5000).json()) == len(NAMES)
    assert "x-next-cursor" not in _get(api, limit=5000).headers
    too_big = _get(api, limit=5001)
    assert (too_big.status_code, too_big.json()) == (422, {"detail": "query.limit: Input should be less than "
                                                                     "or equal to 5000"})
    bad = _get(api, cursor="' OR 1=1 --")
    assert (bad.status_code, bad.json()) == (400, {"detail": "invalid cursor"})
    api.stores.incidents.upsert_runs([api.run.__class__(project=PROJECT, run_id="run-2", started_ns=1)])
    other_run = httpx.get(f"{api.url}/api/v1/runs/run-2/metrics/summary",
                          params={"cursor": _get(api, limit=10).headers["x-next-cursor"]},
                          headers=api.headers(), timeout=60)
    assert (other_run.status_code, other_run.json()) == (400, {"detail": "invalid cursor"})


def test_the_next_link_of_a_run_id_of_any_text_reads_that_run(api: LiveApi) -> None:
    run_id = "运行 ü?x#1"  # a legal run id: the Link header must stay ASCII and name this run
    api.stores.incidents.upsert_runs([api.run.__class__(project=PROJECT, run_id=run_id, started_ns=1)])
    api.stores.metrics.put([MetricPoint(PROJECT, run_id, 0, n, 1, 1, 1.0) for n in ("a", "b", "c")])
    first = httpx.get(f"{api.url}/api/v1/runs/{quote(run_id, safe='')}/metrics/summary", params={"limit": 2},
                      headers=api.headers(), timeout=60)
    assert first.status_code == 200, first.text  # was 500 (UnicodeEncodeError writing the Link header)
    link = first.headers["link"]
    assert link.startswith("</api/v1/runs/%E8%BF%90%E8%A1%8C%20%C3%BC%3Fx%231/metrics/summary?limit=2&cursor=")
    second = httpx.get(api.url + link[1:link.index(">")], headers=api.headers(), timeout=60)
    assert [s["name"] for s in first.json() + second.json()] == ["a", "b", "c"]
