"""SqliteMetricStore writes a round's points with multi-row statements (``_upsert_points``,
POINTS_PER_STATEMENT rows each, then powers of two): the table they leave equals one single-row upsert a
point in the same order -- a later point of a key replaces an earlier one of the same statement or of an
earlier one, NaN and +-Inf keep their codes -- whatever the count."""

from __future__ import annotations

import math
import random
import sqlite3
from pathlib import Path
from typing import Any, List, Tuple

import pytest

from trainguard_server.storage import sqlite as store_sqlite
from trainguard_server.storage.base import MetricColumns, MetricPoint
from trainguard_server.storage.sqlite import POINTS_PER_STATEMENT, SqliteMetricStore

SeriesWrites = List[Tuple[int, Tuple[List[int], List[int], List[float]]]]

SPECIAL = (math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, 5e-324)
_ONE_ROW = ("INSERT OR REPLACE INTO points (sid, step, time_ns, value, nf) VALUES (?1, ?2, ?3, "
            "CASE WHEN abs(?4) < 9e999 THEN ?4 END, CASE WHEN abs(?4) < 9e999 THEN 0 WHEN ?4 IS NULL THEN 1 "
            "WHEN ?4 > 0 THEN 2 ELSE 3 END)")
"""The reference: one point a statement, the non-finite codes (storage/common.py) written out -- the
statements under test are built another way (a SELECT over a multi-row VALUES)."""


def _writes(seed: int, total: int) -> SeriesWrites:
    """``total`` points over a few series, steps drawn from a small range (many repeated keys, also within
    one statement and across a statement's border), values with NaN, +-Inf, signed zeros, extremes."""
    rng = random.Random(seed)
    out: SeriesWrites = []
    left = total
    sid = 0
    while left:
        sid += rng.randint(1, 3)
        n = min(left, rng.randint(1, 2 * POINTS_PER_STATEMENT))
        steps = [rng.randint(0, max(1, n // 2)) for _ in range(n)]
        times = [10**18 + rng.randint(0, 10**9) for _ in range(n)]
        values = [rng.choice(SPECIAL) if rng.random() < 0.1 else rng.uniform(-1e3, 1e3) for _ in range(n)]
        out.append((sid, (steps, times, values)))
        left -= n
    return out


def _table(conn: sqlite3.Connection) -> List[Tuple[Any, ...]]:
    return [tuple(repr(v) for v in row) for row in conn.execute("SELECT * FROM points ORDER BY sid, step")]


def _fresh(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), isolation_level=None)
    for statement in store_sqlite._statements(store_sqlite._METRICS_SCHEMA):
        conn.execute(statement)
    return conn


@pytest.mark.parametrize("total", [1, 2, 3, 63, 127, POINTS_PER_STATEMENT, POINTS_PER_STATEMENT + 1,
                                   2 * POINTS_PER_STATEMENT - 1, 777, 4096 + 5])
def test_multi_row_statements_leave_what_single_rows_leave(tmp_path: Path, total: int) -> None:
    writes = _writes(total, total)
    assert sum(len(cols[0]) for _sid, cols in writes) == total
    mine, reference = _fresh(tmp_path / "a.db"), _fresh(tmp_path / "b.db")
    try:
        for _ in range(2):  # a second write over the first: every key replaced again
            store_sqlite._upsert_points(mine, writes)
            reference.executemany(_ONE_ROW, (
                (sid, step, time_ns, value) for sid, cols in writes for step, time_ns, value in zip(*cols)))
            assert _table(mine) == _table(reference)
        keys = {(sid, step) for sid, cols in writes for step in cols[0]}
        assert len(_table(mine)) == len(keys)
    finally:
        mine.close()
        reference.close()


def test_a_later_point_of_a_key_wins_across_a_statement_border(tmp_path: Path) -> None:
    """Points 0..N of one series where the point after the first statement's last has the same step:
    the later value is kept (and within a statement too)."""
    n = POINTS_PER_STATEMENT
    steps = [*range(n), n - 1, 5, 5]
    values = [float(i) for i in range(len(steps))]
    store = SqliteMetricStore(tmp_path / "metrics.db")
    try:
        columns = MetricColumns.of(MetricPoint("p", "r", 0, "loss", s, 1000 + s, v) for s, v in zip(steps, values))
        store.put_columns(columns)
        got = {b.step_start: b.last for b in store.series("p", "r", ["loss"], max_points=10_000)["loss"][0]}
        assert got[n - 1] == float(n) and got[5] == float(n + 2) and got[0] == 0.0 and len(got) == n
    finally:
        store.close()
