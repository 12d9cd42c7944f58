"""One project's readers cannot starve another's: each project has at most ``api_max_requests_per_project``
query-API requests in flight; one more waits for a slot at most ``api_request_wait_s``, then gets 429 with
``Retry-After`` and a message naming the setting, while another project's requests are answered. Before, 80
clients of one project listing and searching at once slowed every project's reads (and ingest) from
~0.01-0.04 s to 0.3-2.5 s: nothing bounded them per project.

Here project "vision" holds its 2 slots with heavy metric reads (80 series x 3,000 steps), one running and
one waiting for the project's one metric-read slot (``api_max_concurrent_queries_per_project``). A real uvicorn
server on 127.0.0.1 over SQLite stores; no assertion on speed."""

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

OTHER = "other-team"
NAMES = [f"layer{i:02d}/grad_norm" for i in range(20)]


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveApi]:
    root = tmp_path_factory.mktemp("slots")
    store = SqliteMetricStore(root / METRICS_DB, synchronous="OFF")
    store.put([MetricPoint(PROJECT, "run-1", r, n, s, s, 1.0 + s % 7)
               for n in NAMES for r in range(4) for s in range(3000)])
    store.close()
    live = LiveApi(root, api_max_requests_per_project=2, api_request_wait_s=0.3, retry_after_s=2.0,
                   api_max_concurrent_queries_per_project=1)
    live.stores.incidents.upsert_runs([RunRecord(project=OTHER, run_id="small", started_ns=time.time_ns())])
    try:
        yield live
    finally:
        live.close()


def _heavy(api: LiveApi, answers: List[int]) -> threading.Thread:
    def read() -> None:
        r = httpx.get(f"{api.url}/api/v1/runs/run-1/metrics", params={"max_points": 10_000},
                      headers=api.headers(), timeout=120)
        answers.append(r.status_code)

    thread = threading.Thread(target=read)
    thread.start()
    return thread


def test_a_project_past_its_requests_in_flight_gets_429_and_another_project_is_answered(api: LiveApi) -> None:
    other_read = api.stores.projects.create_token(OTHER, "read")
    answers: List[int] = []
    readers: List[threading.Thread] = []
    deadline = time.monotonic() + 60
    refused = None
    while refused is None:  # while two heavy reads hold vision's 2 slots, its next request is refused
        assert time.monotonic() < deadline, "the heavy reads never held the project's slots"
        readers = [t for t in readers if t.is_alive()]
        while len(readers) < 2:
            readers.append(_heavy(api, answers))
        slots = getattr(api.app.state, "project_request_slots", None)  # before the fix: never (no slots)
        if slots is None or PROJECT not in slots._slots or not slots._slots[PROJECT].locked():
            time.sleep(0.005)
            continue
        r = httpx.get(f"{api.url}/api/v1/runs", headers=api.headers(), timeout=30)
        assert r.status_code in (200, 429), r.text
        if r.status_code == 429:
            refused = r
            # the other project is answered meanwhile, whatever it reads
            for path in ("/api/v1/runs", "/api/v1/runs/small", "/api/v1/search?q=loss", "/api/v1/incidents",
                         "/api/v1/runs/small/metrics/summary"):
                mine = httpx.get(f"{api.url}{path}", headers=api.headers(other_read), timeout=30)
                assert mine.status_code == 200, (path, mine.text)
    assert refused.headers["retry-after"] == "2"
    assert refused.json() == {"detail": "project 'vision' has 2 query-API requests in flight, the most one "
                                        "project may (TRAINGUARD_API_MAX_REQUESTS_PER_PROJECT), and none "
                                        "finished within api_request_wait_s=0.3 s: retry after 2 s"}
    for thread in readers:
        thread.join(120)
    assert set(answers) <= {200, 429}, answers
    assert answers.count(200) >= 2  # the heavy reads themselves were answered
    # once they are done, the project's slots are free again
    assert httpx.get(f"{api.url}/api/v1/runs", headers=api.headers(), timeout=30).status_code == 200


def test_the_openapi_documents_the_429(api: LiveApi) -> None:
    paths = httpx.get(f"{api.url}/openapi.json", timeout=30).json()["paths"]
    refused = paths["/api/v1/runs"]["get"]["responses"]["429"]
    assert "api_max_requests_per_project" in refused["description"] and "Retry-After" in refused["headers"]
    assert "429" in paths["/api/v1/search"]["get"]["responses"]
