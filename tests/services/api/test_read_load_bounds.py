"""Issue 18, finding 13: heavy reads must not slow ingest for everyone. Metric reads are bounded in size
(``api_max_metric_buckets``: a downsampled answer, or 400), in time (``api_query_timeout_s``: 503) and in
concurrency (``api_max_concurrent_queries``), live streams in number (``api_max_streams``,
``api_max_streams_per_token``) and in rate (``api_stream_min_interval_s``), and an ingest request succeeds
while heavy reads run. A real uvicorn server on 127.0.0.1 over SQLite stores; no assertion on speed."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import httpx
import pytest

from tests.services.api.live_server import PROJECT, LiveApi, sse_messages, take
from tests.services.gateway.helpers import metric_event
from trainguard_server.storage.base import MetricPoint
from trainguard_server.storage.sqlite import METRICS_DB, SqliteMetricStore

NAMES = [f"layer{i:02d}/grad_norm" for i in range(20)]
RANKS = (0, 1, 2, 3)
STEPS = 3000
SPIKE = (NAMES[0], 0, 1234, 1e6)  # name, rank, step, value: must survive any downsampling
SERIES = len(NAMES) * len(RANKS)  # 80
TIMEOUT = httpx.Timeout(60.0)  # generous: answers are expected, their speed is not measured


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with 80 series of 3000 steps (240,000 points) in a SQLite metric store."""
    root = tmp_path_factory.mktemp("heavy")
    store = SqliteMetricStore(root / METRICS_DB, synchronous="OFF")
    name, rank, step, value = SPIKE
    store.put([MetricPoint(PROJECT, "run-1", r, n, s, s, value if (n, r, s) == (name, rank, step) else 1.0 + s % 7)
               for n in NAMES for r in RANKS for s in range(STEPS)])
    store.close()
    return root


@pytest.fixture
def serve(data_dir: Path) -> Iterator[Any]:
    opened: List[LiveApi] = []

    def start(**settings: Any) -> LiveApi:
        opened.append(LiveApi(data_dir, **settings))
        return opened[-1]
    yield start
    for api in opened:
        api.close()


def metrics(api: LiveApi, **params: Any) -> httpx.Response:
    return httpx.get(f"{api.url}/api/v1/runs/run-1/metrics", params=params, headers=api.headers(), timeout=TIMEOUT)


def buckets(body: Dict[str, Any]) -> int:
    return sum(len(bs) for by_rank in body["series"].values() for bs in by_rank.values())


def test_a_metrics_answer_is_downsampled_to_the_bucket_budget(serve: Any) -> None:
    api = serve(api_max_metric_buckets=7000)  # 2 series x 3000 fit, 80 x 3000 do not
    answer = metrics(api, max_points=10_000)  # before the fix: all 240,000 points, a bucket each
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["max_points"] == 7000 // SERIES == 87
    assert len(body["series"]) == len(NAMES) and all(len(v) == len(RANKS) for v in body["series"].values())
    assert buckets(body) <= 7000
    assert all(len(bs) <= 87 for by_rank in body["series"].values() for bs in by_rank.values())
    name, rank, _, value = SPIKE
    assert max(b["max"] for b in body["series"][name][str(rank)]) == value  # the spike survives
    assert sum(b["count"] for b in body["series"][name][str(rank)]) == STEPS
    # a query that fits is answered as asked
    small = metrics(api, names=f"{NAMES[1]},{NAMES[2]}", rank=1, max_points=STEPS).json()
    assert small["max_points"] == STEPS and buckets(small) == 2 * STEPS


def test_more_series_than_the_bucket_budget_is_refused(serve: Any) -> None:
    api = serve(api_max_metric_buckets=50)
    answer = metrics(api, max_points=10)
    assert answer.status_code == 400
    assert answer.json() == {"detail": f"the query selects {SERIES} series, more than api_max_metric_buckets=50 "
                                       f"buckets in all: name fewer metrics (names=) or one rank (rank=)"}
    assert metrics(api, names=NAMES[0], max_points=10).status_code == 200  # 4 series fit


@pytest.mark.parametrize("path", ["metrics", "metrics/summary"])
def test_a_read_past_its_time_budget_is_stopped(serve: Any, path: str) -> None:
    api = serve(api_query_timeout_s=0.001, retry_after_s=3.0)
    answer = httpx.get(f"{api.url}/api/v1/runs/run-1/{path}", params={"max_points": 10_000},
                       headers=api.headers(), timeout=TIMEOUT)
    assert answer.status_code == 503, answer.status_code  # before the fix: 200 after the whole scan
    assert answer.headers["retry-after"] == "3"
    assert answer.json()["detail"].startswith("the query ran past api_query_timeout_s=0.001 s and was stopped")


def test_ingest_succeeds_while_heavy_reads_and_streams_run(serve: Any) -> None:
    api = serve(api_max_concurrent_queries=2, api_stream_min_interval_s=0.2)
    answers: List[httpx.Response] = []
    stop = threading.Event()

    def heavy() -> None:
        answers.append(metrics(api, max_points=10_000))

    def watch() -> None:
        with httpx.stream("GET", f"{api.url}/api/v1/runs/run-1/stream", params={"interval": 0.2},
                          headers=api.headers(api.stores.projects.create_token(PROJECT, "read")),
                          timeout=TIMEOUT) as response:
            for _ in response.iter_raw():
                if stop.is_set():
                    return

    readers = [threading.Thread(target=heavy) for _ in range(6)] + [threading.Thread(target=watch) for _ in range(8)]
    for thread in readers:
        thread.start()
    deadline = time.monotonic() + 60
    while not getattr(api.app.state, "metric_query_slots", None) or not api.app.state.metric_query_slots.locked():
        assert time.monotonic() < deadline, "the heavy reads never started"
        time.sleep(0.005)
    event = metric_event(5, project=PROJECT, run_id="run-2", time_unix_nano=time.time_ns())
    ingest = httpx.post(f"{api.url}/v1/ingest", content=json.dumps({"events": [event]}),
                        headers={"Authorization": f"Bearer {api.ingest_token}", "Content-Type": "application/json"},
                        timeout=TIMEOUT)
    assert (ingest.status_code, ingest.json()) == (200, {"accepted": 1, "duplicates": 0, "rejected": []})
    stop.set()
    for thread in readers:
        thread.join(60)
    # every read got a bounded answer: a body within the default api_max_metric_buckets, or -- when the
    # slots stayed busy longer than api_query_timeout_s -- a 503 that says when to come back
    assert len(answers) == 6
    for answer in answers:
        assert answer.status_code in (200, 503), answer.text
        if answer.status_code == 200:
            assert buckets(answer.json()) <= 50_000
        else:
            assert answer.headers["retry-after"] == "1" and "api_query_timeout_s=10 s" in answer.json()["detail"]


def open_stream(api: LiveApi, token: str) -> Any:
    return httpx.stream("GET", f"{api.url}/api/v1/runs/run-1/stream", headers=api.headers(token),
                        timeout=httpx.Timeout(10.0))


def test_live_streams_are_bounded_per_token_and_in_all(serve: Any) -> None:
    api = serve(api_max_streams=3, api_max_streams_per_token=2, api_stream_min_interval_s=0.2, retry_after_s=2.0)
    first, second = (api.stores.projects.create_token(PROJECT, "read") for _ in range(2))
    a1, a2 = open_stream(api, first), open_stream(api, first)
    assert a1.__enter__().status_code == a2.__enter__().status_code == 200
    with open_stream(api, first) as refused:  # before the fix: 200, and as many as anyone asks for
        refused.read()
        assert refused.status_code == 429
        assert refused.json() == {"detail": "2 live streams are open for this token (api_max_streams_per_token): "
                                            "close one first"}
    with open_stream(api, second) as b1:
        assert b1.status_code == 200
        with open_stream(api, second) as full:
            full.read()
            assert (full.status_code, full.headers["retry-after"]) == (503, "2")
            assert full.json() == {"detail": "3 live streams are open (api_max_streams): retry later"}
        a1.__exit__(None, None, None)  # a closed stream gives its slot back
        deadline = time.monotonic() + 30
        while True:
            with open_stream(api, second) as again:
                if again.status_code == 200:
                    assert [e for e, _ in take(sse_messages(again), 2)] == ["run", "incidents"]
                    break
            assert time.monotonic() < deadline, "the closed stream's slot never came back"
            time.sleep(0.1)
    a2.__exit__(None, None, None)


def test_a_stream_checks_no_more_often_than_the_minimum_interval(serve: Any) -> None:
    import dataclasses

    api = serve(api_stream_min_interval_s=30.0)
    with httpx.stream("GET", f"{api.url}/api/v1/runs/run-1/stream", params={"interval": 0.2},
                      headers=api.headers(), timeout=httpx.Timeout(10.0, read=1.5)) as response:
        messages = sse_messages(response)
        assert [e for e, _ in take(messages, 2)] == ["run", "incidents"]
        api.stores.incidents.upsert_runs([dataclasses.replace(api.run, last_step=99)])
        with pytest.raises(httpx.ReadTimeout):  # before the fix: the change came 0.2 s later
            next(messages)
