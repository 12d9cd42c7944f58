"""One project's heavy metric reads must leave the other projects a query slot. Every metric read (series,
summary) takes one of ``api_max_concurrent_queries`` slots; a project asking for heavy reads many at a time
(8 clients on the summary of a run with 200,000 metric names, in a probe of ``trainguard serve``) held all of
them, and another project's plain read waited 7-10 s or got 503. Now one project holds at most
``api_max_concurrent_queries_per_project`` of them: while its reads queue on its own slots, a slot stays
free and the other project's read is answered. A real uvicorn server on 127.0.0.1 over SQLite stores."""

from __future__ import annotations

import threading
import time
from typing import Iterator, List

import httpx
import pytest

from tests.services.api.live_server import PROJECT, LiveApi
from trainguard_engine.records import RunRecord
from trainguard_server.storage.base import MetricPoint
from trainguard_server.storage.sqlite import METRICS_DB, SqliteMetricStore

NAMES = [f"layer{i:02d}/grad_norm" for i in range(20)]
STEPS = 3000
OTHER = "other-team"


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveApi]:
    root = tmp_path_factory.mktemp("slots")
    store = SqliteMetricStore(root / METRICS_DB, synchronous="OFF")
    store.put([MetricPoint(PROJECT, "run-1", r, n, s, s, 1.0 + s % 7)
               for n in NAMES for r in range(4) for s in range(STEPS)])  # heavy: 80 series x 3000 steps
    store.put([MetricPoint(OTHER, "small", 0, "loss", s, s, 1.0 / (s + 1)) for s in range(10)])
    store.close()
    live = LiveApi(root, api_max_concurrent_queries=2, api_max_concurrent_queries_per_project=1)
    live.stores.incidents.upsert_runs([RunRecord(project=OTHER, run_id="small", started_ns=time.time_ns())])
    try:
        yield live
    finally:
        live.close()


def test_a_project_flooding_heavy_reads_leaves_another_project_a_slot(api: LiveApi) -> None:
    other_read = api.stores.projects.create_token(OTHER, "read")
    answers: List[int] = []

    def heavy() -> None:
        r = httpx.get(f"{api.url}/api/v1/runs/run-1/metrics", params={"max_points": 10_000},
                      headers=api.headers(), timeout=60)
        answers.append(r.status_code)

    readers = [threading.Thread(target=heavy) for _ in range(6)]
    for thread in readers:
        thread.start()
    state = api.app.state
    deadline = time.monotonic() + 60
    # the flooding project's own slot is taken and its other reads queue on it ...
    while not (getattr(state, "metric_query_project_slots", None)  # before the fix: never (no such slots)
               and state.metric_query_project_slots.get(PROJECT) is not None
               and state.metric_query_project_slots[PROJECT].locked()):
        assert time.monotonic() < deadline, "the heavy reads never took a slot"
        time.sleep(0.005)
    # ... without taking every slot of the app
    assert not state.metric_query_slots.locked()
    r = httpx.get(f"{api.url}/api/v1/runs/small/metrics", params={"names": "loss"},
                  headers=api.headers(other_read), timeout=60)
    assert r.status_code == 200, r.text
    assert [b["count"] for b in r.json()["series"]["loss"]["0"]] == [1] * 10
    for thread in readers:
        thread.join(120)
    assert len(answers) == 6 and set(answers) <= {200, 503}
