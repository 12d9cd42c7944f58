"""SqliteMetricStore.put_columns_many (the processor's metric write-behind): several batches in ONE
transaction leave exactly the tables of one put_columns per batch -- series created by an earlier batch of
the transaction reused (same ids), ranges widened, later points win -- and a failed one writes and caches
nothing."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path
from typing import Any, Dict, List

import pytest

from trainguard_server.storage.base import MetricColumns, MetricPoint
from trainguard_server.storage.sqlite import SqliteMetricStore


def cols(*points: MetricPoint) -> MetricColumns:
    return MetricColumns.of(points)


def pt(step: int, value: float, *, name: str = "loss", rank: int = 0, run_id: str = "r1") -> MetricPoint:
    return MetricPoint("p", run_id, rank, name, step, 1000 + step, value)


def tables(path: Path) -> Dict[str, List[Any]]:
    conn = sqlite3.connect(str(path))
    try:
        return {t: conn.execute(f'SELECT * FROM "{t}" ORDER BY 1, 2').fetchall()
                for t in ("series", "points")}
    finally:
        conn.close()


def batches() -> List[MetricColumns]:
    return [
        cols(pt(5, 1.0), pt(6, 2.0), pt(1, 0.5, name="lr")),              # new series
        cols(pt(7, 3.0), pt(3, 0.1), pt(2, 9.0, rank=1)),                 # widened both ways, a new rank
        cols(pt(6, float("nan")), pt(8, float("inf")), pt(1, 0.7, name="lr", run_id="r2")),  # later wins
        MetricColumns(),                                                  # empty: skipped
        cols(pt(9, 4.0), pt(2, 8.0, rank=1), pt(2, 0.6, name="lr")),
    ]


@pytest.mark.parametrize("warm", [False, True])
def test_one_transaction_leaves_the_tables_of_one_put_per_batch(tmp_path: Path, warm: bool) -> None:
    one, many = SqliteMetricStore(tmp_path / "one.db"), SqliteMetricStore(tmp_path / "many.db")
    if warm:  # the run's series cached before (the processor's usual case)
        for store in (one, many):
            store.put_columns(cols(pt(0, 0.0), pt(0, 0.0, name="lr")))
    for columns in batches():
        one.put_columns(columns)
    many.put_columns_many(batches())
    for store in (one, many):
        store.sync()
    assert tables(tmp_path / "one.db") == tables(tmp_path / "many.db")
    series = many.series("p", "r1", ["loss"])["loss"][0]
    by_step = {b.step_start: b.last for b in series}
    assert sorted(s for s in by_step if s > 0) == [3, 5, 6, 7, 8, 9] and math.isnan(by_step[6])
    # the cache learned the transaction's series: the next write reuses their ids, as after single puts
    one.put_columns(cols(pt(10, 5.0, rank=1)))
    many.put_columns(cols(pt(10, 5.0, rank=1)))
    assert tables(tmp_path / "one.db") == tables(tmp_path / "many.db")
    one.close()
    many.close()


def test_a_failed_transaction_writes_and_caches_nothing(tmp_path: Path) -> None:
    store = SqliteMetricStore(tmp_path / "m.db")
    bad = cols(pt(4, 1.0, name="new"))
    bad.by_rank[("p", "r1", 0)]["new"][2][0] = object()  # type: ignore[index]  # a value SQLite cannot bind
    with pytest.raises((sqlite3.Error, TypeError, ValueError)):
        store.put_columns_many([cols(pt(1, 1.0)), bad])
    assert tables(tmp_path / "m.db") == {"series": [], "points": []}
    store.put_columns_many([cols(pt(1, 1.0)), cols(pt(2, 2.0, name="new"))])
    reference = SqliteMetricStore(tmp_path / "ref.db")
    reference.put_columns(cols(pt(1, 1.0)))
    reference.put_columns(cols(pt(2, 2.0, name="new")))
    assert tables(tmp_path / "m.db") == tables(tmp_path / "ref.db")
    store.close()
    reference.close()
