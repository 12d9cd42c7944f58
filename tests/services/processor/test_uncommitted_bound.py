"""The pipeline pool's replay log (records since the last checkpoint, kept to rebuild a dead worker) is
bounded: over ``pool_log_max_bytes`` the processor checkpoints before taking more, and while that checkpoint
fails it takes nothing (hR's G7 of stop 46: the log grew without bound with checkpoints failing)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, List, Tuple

import pytest

from tests.scenarios.corpus import BY_NAME, retimed
from trainguard import wire
from trainguard_server.processor.embedded import EmbeddedProcessor
from trainguard_server.queue.sqlite import QUEUE_DB, SqliteQueue
from trainguard_server.storage.sqlite import SqliteEventStore, SqliteIncidentStore, SqliteMetricStore


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


def test_over_the_bound_the_processor_checkpoints_before_taking_more(tmp_path: Path) -> None:
    queue, stores, _, _, rest = _setup(tmp_path)
    processor = EmbeddedProcessor(queue, *stores, batch=2, snapshot_every_s=1e9, tick_interval_s=1e15,
                                  processor_workers=1, pool_log_max_bytes=1)
    try:
        assert processor.pool is not None
        processor.run_once(1.0)
        held = processor.pool.log_bytes
        assert held > 1 and processor.stats.snapshots == 0  # no checkpoint due by the clock
        second = rest()
        processor.run_once(1.0)  # over the bound: a checkpoint first, then the next records
        assert processor.stats.held_back == 1 and processor.stats.snapshots == 1
        # only the second half's records since (without the early checkpoint: held + second)
        assert processor.pool.log_bytes == second
    finally:
        processor.stop(drain=False, timeout=5.0)
        _close(queue, stores)


def test_while_checkpoints_fail_over_the_bound_no_record_is_taken(tmp_path: Path, monkeypatch: Any) -> None:
    queue, stores, project, run_id, rest = _setup(tmp_path)
    processor = EmbeddedProcessor(queue, *stores, batch=2, snapshot_every_s=1e9, tick_interval_s=1e15,
                                  processor_workers=1, pool_log_max_bytes=1)
    save = stores[2].save_states
    calls: List[int] = []

    def failing(items: Any) -> None:
        calls.append(len(items))
        raise OSError("disk full")

    try:
        assert processor.pool is not None
        processor.run_once(1.0)
        taken, held = processor.stats.records, processor.pool.log_bytes
        rest()
        monkeypatch.setattr(stores[2], "save_states", failing)
        for _ in range(3):
            with pytest.raises(OSError, match="disk full"):
                processor.run_once(1.0)
        assert len(calls) == 3 and processor.stats.records == taken and processor.pool.log_bytes == held
        assert processor.checkpoint_failures == 3 and "checkpoints failing" in processor.problems()[0]
        monkeypatch.setattr(stores[2], "save_states", save)  # the store is back: everything goes through
        processor.drain(30)
        processor.checkpoint()
        found = [(i.category, i.subtype) for i in stores[2].list_incidents(project, run_id=run_id).items]
    finally:
        processor.stop(drain=False, timeout=5.0)
        _close(queue, stores)
    assert found == [BY_NAME["explosion"].expected]
    assert queue_empty(tmp_path)


def queue_empty(d: Path) -> bool:
    queue = SqliteQueue(d / QUEUE_DB, partitions=4)
    try:
        return queue.depth() == 0
    finally:
        queue.close()
