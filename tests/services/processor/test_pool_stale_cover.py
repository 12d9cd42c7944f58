"""hR's F1 (stop 46): the offsets a pipeline snapshot covers name the queue they were saved for
(``Queue.identity``). A data directory whose queue.db is moved aside -- what serve's own message for a damaged
file advises -- gets a new file that numbers its records from 1 again; a run whose lane the old cover reaches
must still have every record handed to its pipeline (before: all skipped as "already seen", its explosion never
reported), over one partition and over four."""

from __future__ import annotations

import time
from pathlib import Path
from typing import List, Tuple

import pytest

from tests.scenarios.corpus import BY_NAME, retimed
from trainguard import wire
from trainguard_server.processor.embedded import EmbeddedProcessor
from trainguard_server.queue.common import lane_of
from trainguard_server.queue.sqlite import QUEUE_DB, SqliteQueue
from trainguard_server.storage.sqlite import SqliteEventStore, SqliteIncidentStore, SqliteMetricStore

TARGET = "exp-run"


def _same_lane(lanes: int) -> str:
    """A run id in TARGET's lane."""
    i = 0
    while lane_of(f"filler-{i}", lanes) != lane_of(TARGET, lanes):
        i += 1
    return f"filler-{i}"


def _phase(root: Path, name: str, run_id: str, partitions: int) -> List[Tuple[str, str]]:
    """Run ``name``'s recorded stream as ``run_id`` (one envelope a record) through a processor, checkpointed;
    the incidents it has."""
    events = retimed(BY_NAME[name].events(), time.time_ns() - 10**9)
    for event in events:
        event["run_id"] = run_id
    queue = SqliteQueue(root / QUEUE_DB, partitions=partitions)
    stores = (SqliteEventStore(root / "events.db"), SqliteMetricStore(root / "metrics.db"),
              SqliteIncidentStore(root / "incidents.db"))
    try:
        queue.publish(run_id, [wire.prepare_batch([e]).request.SerializeToString() for e in events])
        processor = EmbeddedProcessor(queue, *stores, snapshot_every_s=0.0, tick_interval_s=1e15)
        processor.drain(60)
        processor.checkpoint()
        return [(i.category, i.subtype) for i in
                stores[2].list_incidents(events[0]["project"], run_id=run_id).items]
    finally:
        for part in (queue, *stores):
            part.close()


@pytest.mark.parametrize("partitions", [1, 4])
def test_a_new_queue_file_is_not_skipped_by_the_old_cover(tmp_path: Path, partitions: int) -> None:
    lanes = SqliteQueue(tmp_path / "probe.db").lanes
    _phase(tmp_path, "healthy_mlp", _same_lane(lanes), partitions)
    for suffix in ("", "-wal", "-shm"):  # moved aside: the next open makes a new file
        path = tmp_path / (QUEUE_DB + suffix)
        if path.exists():
            path.rename(tmp_path / (QUEUE_DB + suffix + ".aside"))
    assert _phase(tmp_path, "explosion", TARGET, partitions) == [BY_NAME["explosion"].expected]
