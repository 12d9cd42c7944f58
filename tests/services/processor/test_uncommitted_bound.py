"""The records a processor holds taken and not committed (until its next checkpoint; with a worker pool also
kept to rebuild a dead worker) are bounded: over ``uncommitted_max_bytes`` it checkpoints before taking more,
and while that checkpoint fails it takes nothing, backing off (stop 46's G7: they grew without bound with
checkpoints failing; stop 47's hR M1: each failed checkpoint left one more call in the pool's replay log)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, List, Tuple

import pytest

from tests.scenarios.corpus import BY_NAME, retimed
from trainguard import wire
from trainguard_server.processor import embedded
from trainguard_server.processor.embedded import EmbeddedProcessor
from trainguard_server.processor.pool import CHANGED
from trainguard_server.queue.sqlite import QUEUE_DB, SqliteQueue
from trainguard_server.storage.sqlite import SqliteEventStore, SqliteIncidentStore, SqliteMetricStore

WORKERS = pytest.mark.parametrize("workers", [0, 1])


def _setup(d: Path) -> Tuple[SqliteQueue, Tuple[Any, Any, Any], str, str, Callable[[], int]]:
    """The explosion run's first half queued, and what queues its second half (returning its bytes)."""
    events = retimed(BY_NAME["explosion"].events(), time.time_ns() - 10**9)
    queue = SqliteQueue(d / QUEUE_DB, partitions=4)
    stores = (SqliteEventStore(d / "e.db"), SqliteMetricStore(d / "m.db"), SqliteIncidentStore(d / "i.db"))
    values = [wire.prepare_batch(events[a:a + 10]).request.SerializeToString() for a in range(0, len(events), 10)]
    half = len(values) // 2
    queue.publish(events[0]["run_id"], values[:half])

    def rest() -> int:
        queue.publish(events[0]["run_id"], values[half:])
        return sum(map(len, values[half:]))
    return queue, stores, events[0]["project"], events[0]["run_id"], rest


def _close(queue: Any, stores: Any) -> None:
    for part in (queue, *stores):
        part.close()


@WORKERS
def test_over_the_bound_the_processor_checkpoints_before_taking_more(tmp_path: Path, workers: int) -> None:
    queue, stores, _, _, rest = _setup(tmp_path)
    processor = EmbeddedProcessor(queue, *stores, batch=2, snapshot_every_s=1e9, tick_interval_s=1e15,
                                  processor_workers=workers, uncommitted_max_bytes=1)
    try:
        processor.run_once(1.0)
        held = processor.uncommitted_bytes
        assert held > 1 and processor.stats.snapshots == 0  # no checkpoint due by the clock
        second = rest()
        processor.run_once(1.0)  # over the bound: a checkpoint first, then the next records
        assert processor.stats.early_checkpoints == 1 and processor.stats.snapshots == 1
        assert processor.uncommitted_bytes == second  # the first half committed (else held + second)
    finally:
        processor.stop(drain=False, timeout=5.0)
        _close(queue, stores)


@WORKERS
def test_while_checkpoints_fail_over_the_bound_no_record_is_taken(tmp_path: Path, monkeypatch: Any,
                                                                   workers: int) -> None:
    queue, stores, project, run_id, rest = _setup(tmp_path)
    processor = EmbeddedProcessor(queue, *stores, batch=2, snapshot_every_s=1e9, tick_interval_s=1e15,
                                  processor_workers=workers, uncommitted_max_bytes=1)
    save = stores[2].save_states
    calls: List[int] = []

    def failing(items: Any) -> None:
        calls.append(len(items))
        raise OSError("disk full")

    try:
        processor.run_once(1.0)
        taken, held = processor.stats.records, processor.uncommitted_bytes
        rest()
        monkeypatch.setattr(stores[2], "save_states", failing)
        with pytest.raises(OSError, match="disk full"):
            processor.run_once(1.0)
        assert processor.run_once(0.0) == 0 and len(calls) == 1  # backing off: not tried again at once
        monkeypatch.setattr(embedded, "MIN_BACKOFF_S", 0.0)  # (the rest without waiting)
        processor._backoff_s, processor._retry_at = 0.0, 0.0
        for _ in range(3):
            with pytest.raises(OSError, match="disk full"):
                processor.run_once(1.0)
        assert len(calls) == 4 and processor.stats.records == taken and processor.uncommitted_bytes == held
        assert processor.checkpoint_failures == 4 and "checkpoints failing" in processor.problems()[0]
        if processor.pool is not None:  # one changed_parts call logged per partition, not one per failure
            for log in processor.pool._log.values():
                assert log.count(CHANGED) <= 1
        monkeypatch.setattr(stores[2], "save_states", save)  # the store is back: everything goes through
        processor.drain(30)
        processor.checkpoint()
        found = [(i.category, i.subtype) for i in stores[2].list_incidents(project, run_id=run_id).items]
    finally:
        processor.stop(drain=False, timeout=5.0)
        _close(queue, stores)
    assert found == [BY_NAME["explosion"].expected]
    again = SqliteQueue(tmp_path / QUEUE_DB, partitions=4)
    try:
        assert again.depth() == 0
    finally:
        again.close()
