"""The processor's metric write-behind (processor/embedded.py METRIC_WRITE_CHUNKS): several chunks' points in
one metric-store transaction, the same tables as one write per chunk, and every flush trigger -- before an
output with incidents is applied, before each checkpoint's store sync (so before any queue commit), on stop,
when a round finds nothing (caught up), after the time bound -- each with a test that fails without it."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import pytest

from trainguard_engine.records import Cluster, Incident, RunRecord
from trainguard_server.processor.embedded import EmbeddedProcessor
from trainguard_server.storage.base import MetricColumns
from trainguard_server.storage.sqlite import SqliteEventStore, SqliteIncidentStore, SqliteMetricStore

from .test_embedded_rounds import PER_REQUEST, STREAM, _publish

NEVER = 1e9


class Metrics(SqliteMetricStore):
    """The real SQLite metric store, counting its transactions and the points stored at each sync()."""

    def __init__(self, path: Path, fail_many: int = 0) -> None:
        super().__init__(path)
        self.transactions = 0
        self.fail_many = fail_many
        self.at_sync: List[int] = []

    def stored(self) -> int:
        return int(self._db.reader().execute("SELECT COUNT(*) FROM points").fetchone()[0])

    def put_columns(self, columns: MetricColumns) -> None:
        self.transactions += 1
        super().put_columns(columns)

    def put_columns_many(self, batches: Sequence[MetricColumns]) -> None:
        if self.fail_many > 0:
            self.fail_many -= 1
            raise sqlite3.OperationalError("database is locked")
        self.transactions += 1
        super().put_columns_many(batches)

    def sync(self) -> None:
        self.at_sync.append(self.stored())
        super().sync()


class Incidents(SqliteIncidentStore):
    """The real SQLite incident store noting, at each upsert with incidents, the metric points stored."""

    metrics: Metrics
    processor: EmbeddedProcessor

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.seen: List[tuple] = []  # type: ignore[type-arg]

    def upsert_records(self, runs: Sequence[RunRecord], incidents: Sequence[Incident],
                       clusters: Sequence[Cluster]) -> None:
        if incidents:
            self.seen.append((self.metrics.stored(), self.processor.stats.metric_points))
        super().upsert_records(runs, incidents, clusters)


def _processor(tmp_path: Path, *, chunks: int, delay_s: float, snapshot_every_s: float = NEVER,
               round_events: int = PER_REQUEST, batch: int = 1, fail_many: int = 0,
               name: str = "", stream: Optional[Path] = None) -> tuple:  # type: ignore[type-arg]
    base = tmp_path / name if name else tmp_path
    queue, envelopes = _publish(base) if stream is None else _publish(base, stream)
    metrics = Metrics(base / "metrics.db", fail_many=fail_many)
    incidents = Incidents(base / "incidents.db")
    processor = EmbeddedProcessor(queue, SqliteEventStore(base / "events.db"), metrics, incidents,
                                  batch=batch, round_events=round_events, round_target_s=0.0,
                                  snapshot_every_s=snapshot_every_s, tick_interval_s=1e15,
                                  metric_write_chunks=chunks, metric_write_delay_s=delay_s)
    incidents.metrics, incidents.processor = metrics, processor
    return queue, envelopes, metrics, incidents, processor


def _tables(path: Path) -> Dict[str, List[Any]]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {t: conn.execute(f'SELECT * FROM "{t}" ORDER BY 1, 2').fetchall()
                for (t,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT IN "
                                         "('store_syncs', 'sqlite_sequence')")}
    finally:
        conn.close()


@pytest.mark.parametrize("chunks", [2, 4, 1000])
def test_several_chunks_in_one_transaction_leave_the_tables_of_one_write_per_chunk(tmp_path: Path,
                                                                                   chunks: int) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    runs = {}
    for name, k in (("a", 1), ("b", chunks)):
        queue, _envelopes, metrics, _incidents, processor = _processor(tmp_path, chunks=k, delay_s=NEVER,
                                                                       name=name)
        processor.drain(timeout=30)
        processor.checkpoint()
        assert queue.depth() == 0
        runs[name] = (processor.stats.rounds, metrics.transactions, processor.stats.metric_points)
        metrics.close()
        queue.close()
    (rounds_a, tx_a, points_a), (rounds_b, tx_b, points_b) = runs["a"], runs["b"]
    assert rounds_a == rounds_b > 10 and points_a == points_b > 0
    assert tx_a >= rounds_a - 2  # one write per chunk with points
    assert tx_b <= -(-tx_a // min(chunks, tx_a)) + 3  # about one per `chunks` chunks (+ the incident's, idle)
    assert _tables(tmp_path / "a" / "metrics.db") == _tables(tmp_path / "b" / "metrics.db")


def test_an_incident_is_never_stored_before_the_points_of_its_chunks(tmp_path: Path) -> None:
    queue, _envelopes, _metrics, incidents, processor = _processor(tmp_path, chunks=1000, delay_s=NEVER)
    processor.drain(timeout=30)
    assert incidents.seen, "the crash stream's exception is an incident"
    for stored, processed in incidents.seen:
        assert stored == processed > 0
    queue.close()


def test_every_checkpoint_sync_comes_after_the_held_points_are_written(tmp_path: Path) -> None:
    queue, _envelopes, metrics, _incidents, processor = _processor(tmp_path, chunks=1000, delay_s=NEVER,
                                                                   snapshot_every_s=0.0)
    syncs = 0
    for _ in range(5):  # a record a round (no incident yet), each round checkpointed
        assert processor.run_once(timeout=1.0) == 1
        assert len(metrics.at_sync) == syncs + 1
        syncs += 1
        assert metrics.at_sync[-1] == processor.stats.metric_points > 0
    queue.close()


def test_stop_writes_the_held_points(tmp_path: Path) -> None:
    queue, _envelopes, metrics, _incidents, processor = _processor(tmp_path, chunks=1000, delay_s=NEVER)
    assert processor.run_once(timeout=1.0) == 1
    assert metrics.stored() == 0 < processor.stats.metric_points  # held
    processor.stop(drain=False)
    assert metrics.stored() == processor.stats.metric_points
    queue.close()


def test_a_round_that_finds_nothing_writes_the_held_points(tmp_path: Path) -> None:
    # the crash stream's first 60 lines: metrics only (its exception, an incident, would write them)
    stream = tmp_path / "metrics_only.jsonl"
    stream.write_text("".join(STREAM.read_text().splitlines(keepends=True)[:60]))
    queue, _envelopes, metrics, incidents, processor = _processor(tmp_path, chunks=1000, delay_s=NEVER,
                                                                  batch=10_000, round_events=100_000,
                                                                  stream=stream)
    assert processor.run_once(timeout=1.0) > 0  # every record, one chunk: its points held
    assert metrics.stored() == 0 < processor.stats.metric_points and not incidents.seen
    processor.run_once(timeout=0.0)
    assert metrics.stored() == processor.stats.metric_points > 0
    queue.close()


def test_points_are_held_at_most_the_time_bound(tmp_path: Path) -> None:
    # (a bound of 2 s: the first round must end inside it, on a slow shared CI machine too)
    queue, _envelopes, metrics, _incidents, processor = _processor(tmp_path, chunks=1000, delay_s=2.0)
    assert processor.run_once(timeout=1.0) == 1
    first = processor.stats.metric_points
    assert metrics.stored() == 0 < first  # held: neither the chunk count nor the bound reached
    time.sleep(2.05)
    assert processor.run_once(timeout=1.0) == 1  # the bound passed: this round writes them all
    assert metrics.stored() == processor.stats.metric_points > first
    queue.close()


def test_a_failed_write_keeps_the_points_held_and_the_tables_end_the_same(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    queue, _e, metrics, _i, processor = _processor(tmp_path, chunks=1, delay_s=NEVER, name="a")
    processor.drain(timeout=30)
    processor.checkpoint()
    queue.close()
    metrics.close()
    queue, _e, metrics, _i, processor = _processor(tmp_path, chunks=3, delay_s=NEVER, fail_many=2, name="b")
    failures = 0
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            if processor.run_once(timeout=0.0) == 0 and not processor._retry and not processor._pending:
                break
        except sqlite3.OperationalError:
            failures += 1
            processor._retry_at = 0.0  # no backoff in a test
    processor.checkpoint()
    assert failures == 2 and queue.depth() == 0
    queue.close()
    metrics.close()
    assert _tables(tmp_path / "a" / "metrics.db") == _tables(tmp_path / "b" / "metrics.db")
