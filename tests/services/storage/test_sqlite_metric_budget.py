"""Issue 18, finding 13: the SQLite metric store stops a read that runs past its time budget
(``MetricStore.time_budget``) with ``QueryTimeout``, inside a long statement as well as between
statements, and the thread's reader stays usable afterwards."""

from __future__ import annotations

import threading
from typing import Iterator, List

import pytest

from trainguard_server.storage.base import MetricPoint, QueryTimeout
from trainguard_server.storage.sqlite import SqliteMetricStore

POINTS = 200_000


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SqliteMetricStore]:
    impl = SqliteMetricStore(tmp_path_factory.mktemp("budget") / "metrics.db", synchronous="OFF")
    impl.put([MetricPoint("p", "big", 0, name, s, s, float(s % 97)) for name in ("loss", "lr")
              for s in range(POINTS)])
    yield impl
    impl.close()


@pytest.mark.parametrize("read", ["series", "summary", "names", "series_keys"])
def test_a_spent_budget_stops_every_read(store: SqliteMetricStore, read: str) -> None:
    calls = {"series": lambda: store.series("p", "big", ["loss", "lr"], max_points=10_000),
             "summary": lambda: store.summary("p", "big"), "names": lambda: store.names("p", "big"),
             "series_keys": lambda: store.series_keys("p", "big", ["loss"])}
    with store.time_budget(0.0):
        with pytest.raises(QueryTimeout, match=r"^read stopped after its time budget of 0 s$"):
            calls[read]()
    assert store.names("p", "big") == ["loss", "lr"]  # the reader is usable again, outside any budget


def test_a_long_statement_is_interrupted_inside(store: SqliteMetricStore) -> None:
    """One statement over every point: only SQLite's progress handler can stop it before it ends."""
    with store.time_budget(0.002):
        with pytest.raises(QueryTimeout):
            with store._read() as (conn, _):
                conn.execute("SELECT COUNT(*), SUM(value), MAX(time_ns) FROM points").fetchone()
    (loss, lr) = store.summary("p", "big")
    assert (loss.count, lr.count) == (POINTS, POINTS)


def test_the_budget_is_per_thread(store: SqliteMetricStore) -> None:
    seen: List[int] = []

    def other() -> None:
        seen.append(len(store.series("p", "big", ["loss"], max_points=50)["loss"][0]))

    with store.time_budget(0.0):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(60)
        with pytest.raises(QueryTimeout):
            store.series("p", "big", ["loss"], max_points=50)
    assert seen == [50]
