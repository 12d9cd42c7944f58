"""What the MetricStore contract cannot see of the ClickHouse store: its schema (TTL, engines), that
``summary()`` really reads the materialized-view aggregates for append-only series and falls back to the
points for series written twice, the per-minute aggregates, and data surviving a reopen. Run on chDB (the
ClickHouse engine in-process) through clickhouse-connect, one data directory per test."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import pytest

from trainguard_server.storage.base import MetricPoint
from trainguard_server.storage.clickhouse import ClickHouseMetricStore
from trainguard_server.storage.memory import MemoryMetricStore

MINUTE_NS = 60_000_000_000


def pt(step: int, value: float, *, name: str = "loss", rank: int = 0, run_id: str = "r1", project: str = "p",
       time_ns: int = 0) -> MetricPoint:
    return MetricPoint(project=project, run_id=run_id, rank=rank, name=name, step=step,
                       time_ns=time_ns or 1_700_000_000_000_000_000 + step * 1_000_000_000, value=value)


def dsn(tmp_path: Path) -> str:
    return f"chdb://{tmp_path / 'ch'}"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ClickHouseMetricStore]:
    impl = ClickHouseMetricStore.open(dsn=dsn(tmp_path))
    yield impl
    impl.close()


@pytest.fixture
def opener(tmp_path: Path) -> Iterator[Callable[..., ClickHouseMetricStore]]:
    """Opens stores on this test's data directory and closes them all at teardown, failed test or not:
    chDB hosts one engine path per process, so a store left open would break every later test."""
    opened: List[ClickHouseMetricStore] = []

    def open_store(**kwargs: Any) -> ClickHouseMetricStore:
        opened.append(ClickHouseMetricStore.open(dsn=dsn(tmp_path), **kwargs))
        return opened[-1]

    yield open_store
    for each in opened:
        each.close()


def rows(store: ClickHouseMetricStore, sql: str, **params: Any) -> List[Any]:
    return list(store._client.query(sql, parameters=params).result_rows)


def raw_aggregate(store: ClickHouseMetricStore, name: str) -> Dict[str, Any]:
    """What the materialized view put into metric_run_agg, without the dirty-name fallback."""
    (row,) = rows(store, "SELECT sum(points), min(min_value), max(max_value) FROM trainguard.metric_run_agg "
                         "WHERE project = 'p' AND run_id = 'r1' AND name = {name:String}", name=name)
    return {"points": row[0], "min": row[1], "max": row[2]}


def dirty(store: ClickHouseMetricStore) -> List[str]:
    return [r[0] for r in rows(store, "SELECT DISTINCT name FROM trainguard.metric_dirty ORDER BY name")]


def test_schema_engines_order_and_ttl(opener: Callable[..., ClickHouseMetricStore]) -> None:
    with_ttl = opener(retention_days=30)
    engines = dict(rows(with_ttl, "SELECT name, engine FROM system.tables WHERE database = 'trainguard'"))
    assert engines == {
        "metric_points": "ReplacingMergeTree", "metric_series": "AggregatingMergeTree",
        "metric_run_agg": "AggregatingMergeTree", "metric_minute_agg": "AggregatingMergeTree",
        "metric_dirty": "ReplacingMergeTree", "metric_series_mv": "MaterializedView",
        "metric_run_agg_mv": "MaterializedView", "metric_minute_agg_mv": "MaterializedView"}
    (sorting_key,) = rows(with_ttl, "SELECT sorting_key FROM system.tables WHERE database = 'trainguard' "
                                    "AND name = 'metric_points'")[0]
    assert sorting_key == "project, run_id, name, rank, step"

    def ttls(store: ClickHouseMetricStore) -> Dict[str, str]:
        """engine_full of the tables with a TTL; metric_dirty keeps its marks for good."""
        found = {name: engine_full for name, engine_full in rows(
            store, "SELECT name, engine_full FROM system.tables WHERE database = 'trainguard' "
                   "AND engine LIKE '%MergeTree'")}
        assert " TTL " not in found.pop("metric_dirty")
        assert len(found) == 4
        return found

    assert all("toIntervalDay(30)" in e for e in ttls(with_ttl).values()), ttls(with_ttl)
    with_ttl.put([pt(0, 1.0)])
    with_ttl.close()
    # reopening with another retention changes the TTL of the existing tables; 0 removes it
    shorter = opener(retention_days=7)
    assert all("toIntervalDay(7)" in e for e in ttls(shorter).values()), ttls(shorter)
    shorter.close()
    forever = opener(retention_days=0)
    assert all(" TTL " not in e for e in ttls(forever).values()), ttls(forever)
    assert [b.last for b in forever.series("p", "r1", ["loss"])["loss"][0]] == [1.0]


def test_points_survive_a_reopen_and_nan_is_stored_as_nan(opener: Callable[..., ClickHouseMetricStore]) -> None:
    first = opener()
    first.put([pt(0, math.nan), pt(1, math.inf), pt(2, -math.inf), pt(3, 2.5)])
    stored = rows(first, "SELECT step, value, isNaN(value) FROM trainguard.metric_points ORDER BY step")
    assert [(s, n) for s, _, n in stored] == [(0, 1), (1, 0), (2, 0), (3, 0)]
    assert [v for _, v, _ in stored][1:] == [math.inf, -math.inf, 2.5]
    first.close()
    again = opener()
    assert again.names("p", "r1") == ["loss"]
    (summary,) = again.summary("p", "r1")
    assert (summary.count, summary.nonfinite, summary.min, summary.max, summary.last) == (4, 3, 2.5, 2.5, 2.5)


def test_append_only_series_are_summarized_from_the_materialized_view(store: ClickHouseMetricStore) -> None:
    for start in range(0, 300, 100):  # three batches, each after the last
        store.put([pt(s, float(s), rank=r) for s in range(start, start + 100) for r in (0, 1)])
    assert dirty(store) == []
    assert raw_aggregate(store, "loss") == {"points": 600, "min": 0.0, "max": 299.0}
    # rewrite the aggregate behind the store's back: summary() must show it, proving it reads the view
    store._client.command("INSERT INTO trainguard.metric_run_agg (project, run_id, name, points, max_value, "
                          "updated_at) VALUES ('p', 'r1', 'loss', 0, 1e9, now())")
    (summary,) = store.summary("p", "r1")
    assert (summary.count, summary.max, summary.first_step, summary.last_step) == (600, 1e9, 0, 299)


def test_a_batch_applied_twice_is_counted_once(store: ClickHouseMetricStore) -> None:
    batch = [pt(s, float(s)) for s in range(50)] + [pt(s, 1.0, name="lr") for s in range(50)]
    store.put(batch)
    store.put([pt(s, 1.0, name="lr") for s in range(50, 60)])
    store.put(batch)  # the processor re-applies a batch after a crash
    assert dirty(store) == ["loss", "lr"]
    assert raw_aggregate(store, "loss")["points"] == 100  # what the view alone would say
    summaries = {s.name: s for s in store.summary("p", "r1")}
    assert (summaries["loss"].count, summaries["lr"].count, summaries["lr"].last_step) == (50, 60, 59)
    assert sum(b.count for b in store.series("p", "r1", ["loss"])["loss"][0]) == 50


def test_a_replaced_value_leaves_no_trace_in_min_and_max(store: ClickHouseMetricStore) -> None:
    store.put([pt(s, 1.0) for s in range(10)] + [pt(s, 1.0, name="other") for s in range(10)])
    store.put([pt(5, 1e6)])
    store.put([pt(5, 2.0)])  # the spike was a mistake, rewritten
    assert raw_aggregate(store, "loss")["max"] == 1e6
    summaries = {s.name: s for s in store.summary("p", "r1")}
    assert (summaries["loss"].count, summaries["loss"].max) == (10, 2.0)
    assert dirty(store) == ["loss"]  # "other" is still answered by the view
    (minute,) = store.minutes("p", "r1", "loss")
    assert (minute.count, minute.max) == (10, 2.0)


def test_duplicates_out_of_order_in_one_batch_keep_the_last_and_do_not_mark_dirty(
        store: ClickHouseMetricStore) -> None:
    store.put([pt(3, 3.0), pt(1, 1.0), pt(3, 30.0), pt(2, 2.0), pt(1, 10.0)])
    assert dirty(store) == []
    assert [(b.step_start, b.last) for b in store.series("p", "r1", ["loss"])["loss"][0]] == [
        (1, 10.0), (2, 2.0), (3, 30.0)]
    (summary,) = store.summary("p", "r1")
    assert (summary.count, summary.min, summary.max, summary.last) == (3, 2.0, 30.0, 30.0)


def test_per_minute_aggregates(store: ClickHouseMetricStore) -> None:
    t0 = 1_700_000_040 * 1_000_000_000  # a minute boundary
    points = [pt(s, float(s), rank=r, time_ns=t0 + s * 10_000_000_000) for s in range(12) for r in (0, 1)]
    points.append(pt(12, math.nan, time_ns=t0 + 120_000_000_000))
    store.put(points)
    minutes = store.minutes("p", "r1", "loss")
    assert [m.minute_ns for m in minutes] == [t0, t0 + MINUTE_NS, t0 + 2 * MINUTE_NS]
    assert [(m.count, m.first_step, m.last_step, m.min, m.max, m.last) for m in minutes[:2]] == [
        (12, 0, 5, 0.0, 5.0, 5.0), (12, 6, 11, 6.0, 11.0, 11.0)]
    assert minutes[0].mean == 2.5 and minutes[1].mean == 8.5
    last = minutes[2]
    assert (last.count, last.nonfinite) == (1, 1) and math.isnan(last.last) and math.isnan(last.mean)
    assert store.minutes("p", "r1", "missing") == []


def close(a: Any, b: Any) -> bool:
    """Dataclasses (or lists of them) equal field by field; floats to 1e-12 relative, NaN equal to NaN."""
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    if type(a) is not type(b):
        return False
    for key, x in vars(a).items():
        y = vars(b)[key]
        if isinstance(x, float):
            if not ((math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=1e-12)):
                return False
        elif x != y:
            return False
    return True


def test_agrees_with_the_memory_store_on_a_messy_history(store: ClickHouseMetricStore) -> None:
    """Appends, replays, rewrites, several ranks and names, non-finite values: every read equal."""
    memory = MemoryMetricStore()
    batches = [
        [pt(s, math.sin(s), rank=r, name=n) for s in range(0, 400) for r in (0, 1, 2) for n in ("a", "b")],
        [pt(s, math.nan if s % 97 == 0 else s * 0.5, rank=1, name="a") for s in range(350, 700)],
        [pt(s, -float(s), rank=2, name="c") for s in range(-20, 20)],
        [pt(s, math.inf, rank=0, name="b") for s in range(100, 110)],
    ]
    for batch in batches + batches[1:2]:
        store.put(batch)
        memory.put(batch)
    assert store.names("p", "r1") == memory.names("p", "r1")
    assert close(store.summary("p", "r1"), memory.summary("p", "r1"))
    for kwargs in ({}, {"max_points": 7}, {"rank": 1, "start_step": 300, "max_points": 50},
                   {"start_step": -5, "end_step": 360, "max_points": 3}):
        got = store.series("p", "r1", ["a", "b", "c", "zz"], **kwargs)  # type: ignore[arg-type]
        want = memory.series("p", "r1", ["a", "b", "c", "zz"], **kwargs)  # type: ignore[arg-type]
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].keys() == want[name].keys(), (name, kwargs)
            for rank in want[name]:
                assert close(got[name][rank], want[name][rank]), (name, rank, kwargs)


def test_out_of_range_values_and_bad_settings_are_value_errors(store: ClickHouseMetricStore) -> None:
    with pytest.raises(ValueError, match="rank"):
        store.put([pt(0, 1.0, rank=2 ** 31)])
    with pytest.raises(ValueError, match="step"):
        store.put([pt(2 ** 63, 1.0)])
    assert store.names("p", "r1") == []
    with pytest.raises(ValueError, match="database"):
        ClickHouseMetricStore(store._client, database="no-dashes; please")
    with pytest.raises(ValueError, match="retention_days"):
        ClickHouseMetricStore(store._client, retention_days=-1)


def test_a_closed_store_refuses_calls(opener: Callable[..., ClickHouseMetricStore]) -> None:
    closed = opener()
    closed.close()
    closed.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        closed.summary("p", "r1")


def test_an_unreachable_server_fails_at_open() -> None:
    """The HTTP path (a real server) builds its client from host/port/credentials; nothing listens here."""
    with pytest.raises(Exception, match=r"(?i)connect|refused|errno"):
        ClickHouseMetricStore.open(host="127.0.0.1", port=9, username="default", password="",
                                   connect_timeout=2, send_receive_timeout=2)


STREAMS = Path(__file__).resolve().parents[2] / "fixtures" / "streams"


def _floats_close(a: Any, b: Any) -> bool:
    """JSON documents equal, floats to 1e-12 relative (a mean's summation order may differ)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_floats_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_floats_close(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_the_query_api_answers_alike_from_clickhouse_and_memory(
        opener: Callable[..., ClickHouseMetricStore]) -> None:
    """Real recorded runs through the gateway and the processor into each store, then the query API's
    metric endpoints: the ClickHouse store's answers equal the reference implementation's."""
    from fastapi.testclient import TestClient

    from trainguard import wire
    from trainguard.v1 import ingest_pb2
    from trainguard_server.api.app import create_app
    from trainguard_server.api.deps import Services
    from trainguard_server.config import Settings
    from trainguard_server.gateway.http import ingest_router
    from trainguard_server.gateway.ingest import Gateway
    from trainguard_server.processor.embedded import EmbeddedProcessor
    from trainguard_server.queue.memory import MemoryQueue
    from trainguard_server.storage.memory import MemoryEventStore, MemoryIncidentStore, MemoryProjectStore

    answers: Dict[str, Dict[str, Any]] = {}
    for kind in ("memory", "clickhouse"):
        metrics = MemoryMetricStore() if kind == "memory" else opener()
        projects, queue = MemoryProjectStore(), MemoryQueue()
        services = Services(events=MemoryEventStore(), metrics=metrics, incidents=MemoryIncidentStore(),
                            projects=projects, queue=queue)
        settings = Settings(max_past_age_s=10 * 365 * 86400.0)  # the recorded streams are from the past
        gateway = Gateway(queue, projects, settings)
        processor = EmbeddedProcessor(queue, services.events, metrics, services.incidents)
        services.gateway, services.processor, services.settings = gateway, processor, settings
        ingest, read = (projects.create_token("alpha", k) for k in ("ingest", "read"))
        for name in ("diverging", "crashing_2rank"):
            events = [json.loads(line) for line in (STREAMS / f"{name}.jsonl").read_text().splitlines()]
            for event in events:
                event["project"] = "alpha"
            result = gateway.ingest(ingest, ingest_pb2.IngestRequest(
                events=[wire.envelope_from_dict(e) for e in events]))
            assert not result.rejected, result.rejected
        processor.drain()
        client = TestClient(create_app(services, ingest_router(gateway)))
        headers = {"Authorization": f"Bearer {read}"}
        got: Dict[str, Any] = {}
        for run in client.get("/api/v1/runs", headers=headers).json()["items"]:
            base = f"/api/v1/runs/{run['run_id']}/metrics"
            got[run["run_name"]] = [client.get(base, headers=headers, params=params).json()
                                    for params in ({}, {"max_points": 7}, {"rank": 1, "start_step": 3})]
            got[run["run_name"]].append(client.get(f"{base}/summary", headers=headers).json())
        answers[kind] = got
    assert len(answers["memory"]) == 2
    assert all(doc[0]["series"] for doc in answers["memory"].values())  # something to compare
    assert _floats_close(answers["clickhouse"], answers["memory"]), (answers["clickhouse"], answers["memory"])
