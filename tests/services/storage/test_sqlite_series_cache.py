"""SqliteMetricStore's series-id cache (the processor's write path): ids are cached only once their
transaction committed, another writer's series are found, evicted runs are read back, and a recorded
stream written the processor's way (columns per round) reads back exactly as point by point."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path
from typing import Any, List, Tuple

import pytest

from tests.engine.test_pipeline_golden import streams
from trainguard import wire
from trainguard_server.processor.decode import decode_request
from trainguard_server.storage.base import MetricColumns, MetricPoint, MetricStore
from trainguard_server.storage.memory import MemoryMetricStore
from trainguard_server.storage.sqlite import SqliteMetricStore


def pt(step: int, value: float, *, name: str = "loss", rank: int = 0, run_id: str = "r1") -> MetricPoint:
    return MetricPoint("p", run_id, rank, name, step, 1000 + step, value)


def series_rows(path: Path) -> List[Tuple[Any, ...]]:
    conn = sqlite3.connect(str(path))
    try:
        return conn.execute("SELECT project, run_id, name, rank, min_step, max_step FROM series "
                            "ORDER BY project, run_id, name, rank").fetchall()
    finally:
        conn.close()


def lasts(store: MetricStore, run_id: str = "r1", name: str = "loss", rank: int = 0) -> List[Tuple[int, float]]:
    return [(b.step_start, b.last) for b in store.series("p", run_id, [name])[name].get(rank, [])]


def test_a_failed_write_caches_no_series_id(tmp_path: Path) -> None:
    """A round whose transaction rolls back (here: a value SQLite cannot bind, after the new series row was
    inserted in it) must not leave that series' id in the cache: the next write would put its points under
    an id no series row has, and they would never be read."""
    store = SqliteMetricStore(tmp_path / "metrics.db")
    try:
        bad = MetricColumns()
        bad.add("p", "r1", 0, 1000, [("loss", 1, object())])  # type: ignore[list-item]
        with pytest.raises(sqlite3.Error):
            store.put_columns(bad)
        assert series_rows(tmp_path / "metrics.db") == []
        store.put([pt(1, 0.5), pt(2, 0.25)])
        assert lasts(store) == [(1, 0.5), (2, 0.25)]
        assert series_rows(tmp_path / "metrics.db") == [("p", "r1", "loss", 0, 1, 2)]
    finally:
        store.close()


def test_series_another_writer_created_are_found(tmp_path: Path) -> None:
    """Two stores on one file (e.g. a restarted processor beside an old one): A has run r1 cached, B adds a
    series to r1 and widens one; A's later points of that series go to B's series row, not a second one,
    and the step ranges cover both writers' points."""
    a = SqliteMetricStore(tmp_path / "metrics.db")
    b = SqliteMetricStore(tmp_path / "metrics.db")
    try:
        a.put([pt(5, 1.0), pt(6, 2.0)])
        b.put([pt(1, 9.0), pt(8, 3.0, name="lr", rank=1)])
        a.put([pt(9, 4.0, name="lr", rank=1), pt(7, 5.0)])
        assert series_rows(tmp_path / "metrics.db") == [("p", "r1", "loss", 0, 1, 7), ("p", "r1", "lr", 1, 8, 9)]
        for store in (a, b):
            assert lasts(store) == [(1, 9.0), (5, 1.0), (6, 2.0), (7, 5.0)]
            assert lasts(store, name="lr", rank=1) == [(8, 3.0), (9, 4.0)]
    finally:
        a.close()
        b.close()


def test_evicted_runs_are_read_back(tmp_path: Path) -> None:
    """With room for 3 series, 5 runs of 2 series each evict one another; writing an evicted run again
    reuses its stored series (one row per series, ranges widened) and every point reads back."""
    store = SqliteMetricStore(tmp_path / "metrics.db", series_cache_max=3)
    try:
        runs = [f"r{i}" for i in range(5)]
        for rnd in range(3):
            for i, run_id in enumerate(runs):
                store.put([pt(10 * rnd + i, float(rnd), run_id=run_id), pt(10 * rnd, -1.0, name="lr", run_id=run_id)])
        rows = series_rows(tmp_path / "metrics.db")
        assert len(rows) == 10
        for i, run_id in enumerate(runs):
            assert ("p", run_id, "loss", 0, i, 20 + i) in rows
            assert lasts(store, run_id) == [(i, 0.0), (10 + i, 1.0), (20 + i, 2.0)]
    finally:
        store.close()


@pytest.mark.parametrize("name", ["corpus/nan_source", "corpus/gpu_amp_overflow", "nccl/nan_one_rank",
                                  "fixture/crashing_2rank"])
def test_a_recorded_stream_in_rounds_reads_back_as_point_by_point(name: str, tmp_path: Path) -> None:
    """A recorded stream decoded as the processor decodes it, written in rounds of columns (the processor's
    path), equals the reference store given every point with :meth:`put` -- NaN and Inf included."""
    events, _settings = streams()[name]
    envelopes = events()
    store = SqliteMetricStore(tmp_path / "metrics.db")
    reference = MemoryMetricStore()
    try:
        for i in range(0, len(envelopes), 37):
            decoded, points = decode_request(wire.prepare_batch(envelopes[i:i + 37]).request.SerializeToString())
            columns = MetricColumns()
            flat = []
            for env, mine in zip(decoded, points):
                if mine:
                    ident = (env.get("project", ""), env.get("run_id", ""), int(env.get("rank", 0)))
                    time_ns = int(env.get("time_unix_nano", 0))
                    columns.add(*ident, time_ns, mine)
                    flat += [MetricPoint(*ident[:2], ident[2], n, s, time_ns, v) for n, s, v in mine]
            store.put_columns(columns)
            reference.put(flat)
        runs = {(p.project, p.run_id) for p in flat}
        assert runs
        checked = 0
        for project, run_id in runs:
            names = reference.names(project, run_id)
            assert store.names(project, run_id) == names
            want = reference.series(project, run_id, names, max_points=100_000)
            got = store.series(project, run_id, names, max_points=100_000)
            for metric, by_rank in want.items():
                assert sorted(got[metric]) == sorted(by_rank)
                for rank, buckets in by_rank.items():
                    mine = [(b.step_start, b.count, b.last) for b in got[metric][rank]]
                    theirs = [(b.step_start, b.count, b.last) for b in buckets]
                    assert len(mine) == len(theirs)
                    for x, y in zip(mine, theirs):
                        assert x[:2] == y[:2] and (x[2] == y[2] or (math.isnan(x[2]) and math.isnan(y[2])))
                        checked += 1
        assert checked > 50
    finally:
        store.close()
