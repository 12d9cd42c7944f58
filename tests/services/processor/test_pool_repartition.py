"""A data directory whose queue turns partitioned (processor_workers set on it) keeps its runs' detection state:
the one-partition snapshot is handed to the partitions (processor/repartition.py), each run to its own.

The scenario corpus (real trainings, several projects' runs, exceptions that cluster) is processed half over a
one-partition SQLite queue and checkpointed; the rest is published and processed after a restart over the
same queue file turned 4-partition (in the thread, and with 2 workers). The incidents, runs and clusters
tables must equal those of the same two halves with the queue left at one partition -- no incident reported
again, no cluster count restarted -- and the one-partition keys must be gone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from tests.scenarios.corpus import BY_NAME, SCENARIOS
from tests.services.processor.test_pool_exact import table_digests
from trainguard import wire
from trainguard_engine.catalogue import DetectionSettings
from trainguard_server.config import Settings
from trainguard_server.processor.embedded import PARTS_PREFIX, EmbeddedProcessor
from trainguard_server.queue.common import lane_of
from trainguard_server.queue.sqlite import QUEUE_DB, SqliteQueue
from trainguard_server.storage.select import open_stores

RECORD = 50
SETTINGS = DetectionSettings.from_overrides({"stall_min_s": 5.0})


def _halves() -> Tuple[List[Tuple[str, bytes]], List[Tuple[str, bytes]]]:
    first, second = [], []
    for scenario in SCENARIOS:
        events = scenario.events()
        run_id = str(events[0]["run_id"])
        values = [wire.prepare_batch(events[i:i + RECORD]).request.SerializeToString()
                  for i in range(0, len(events), RECORD)]
        half = (len(values) + 1) // 2
        first.extend((run_id, v) for v in values[:half])
        second.extend((run_id, v) for v in values[half:])
    return first, second


def _drain(root: Path, records: List[Tuple[str, bytes]], partitions: int, workers: int) -> None:
    queue = SqliteQueue(root / QUEUE_DB, max_depth=100_000, partitions=partitions)
    stores = open_stores(Settings(), root)
    try:
        for key, value in records:
            queue.publish(key, [value])
        processor = EmbeddedProcessor(queue, stores.events, stores.metrics, stores.incidents, SETTINGS,
                                      snapshot_every_s=0.0, tick_interval_s=1e15, round_target_s=0.0,
                                      processor_workers=workers)
        processor.stop(drain=True, timeout=120)
        assert queue.depth() == 0
    finally:
        queue.close()
        stores.close()


def _tables(root: Path) -> Dict[str, str]:
    digests = table_digests(root / "incidents.db")
    return {t: digests[t] for t in ("incidents", "runs", "clusters")}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_queue_turned_partitioned_keeps_every_run_state(tmp_path: Path, workers: int) -> None:
    first, second = _halves()
    _drain(tmp_path / "kept", first, 1, 0)
    _drain(tmp_path / "kept", second, 1, 0)
    expected = _tables(tmp_path / "kept")
    assert "rows=0" not in expected["incidents"] and "rows=0" not in expected["clusters"]

    _drain(tmp_path / "turned", first, 1, 0)
    _drain(tmp_path / "turned", second, 4, workers)
    assert _tables(tmp_path / "turned") == expected
    stores = open_stores(Settings(), tmp_path / "turned")
    try:
        assert stores.incidents.state_keys(PARTS_PREFIX) == []
    finally:
        stores.close()


def test_back_to_one_partition_warns_of_the_partition_states(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    """hR2's G5: a data dir whose queue is one partition again (queue.db moved aside, processor_workers unset)
    ignored the per-partition states without a word."""
    from trainguard_server.processor.embedded import PARTITION_PREFIX

    stores = open_stores(Settings(), tmp_path)
    try:
        stores.incidents.save_state(f"{PARTITION_PREFIX}2/run/x", b"{}")
        queue = SqliteQueue(tmp_path / QUEUE_DB)
        with caplog.at_level("WARNING", logger="trainguard.processor"):
            EmbeddedProcessor(queue, stores.events, stores.metrics, stores.incidents).stop(drain=False)
        assert any("per-partition pipeline snapshots" in r.getMessage() for r in caplog.records)
    finally:
        stores.close()


def _crashed(root: Path, records: List[Tuple[str, bytes]]) -> None:
    """``records`` processed over the one-partition queue and applied to the stores, never checkpointed: a
    crash (they are delivered again at the next start)."""
    queue = SqliteQueue(root / QUEUE_DB, max_depth=100_000, partitions=1)
    stores = open_stores(Settings(), root)
    try:
        for key, value in records:
            queue.publish(key, [value])
        processor = EmbeddedProcessor(queue, stores.events, stores.metrics, stores.incidents, SETTINGS,
                                      snapshot_every_s=1e12, tick_interval_s=1e15, round_target_s=0.0)
        while processor.run_once(0.0):
            pass
        assert queue.depth() > 0 and stores.incidents.list_clusters("scenarios").items
    finally:
        queue.close()
        stores.close()


def _crash_runs(count: int, scratch: Path) -> List[List[Tuple[str, bytes]]]:
    """The corpus 'crash' run under ``count`` run ids of different partitions at P=4: one cluster (the same
    exception) spanning them."""
    probe = SqliteQueue(scratch / QUEUE_DB)
    lanes = probe.lanes
    probe.close()
    ids: List[str] = []
    for i in range(64):
        run_id = f"crash-{i}"
        if lane_of(run_id, lanes) % 4 not in {lane_of(r, lanes) % 4 for r in ids}:
            ids.append(run_id)
        if len(ids) == count:
            break
    events = BY_NAME["crash"].events()
    out = []
    for run_id in ids:
        mine = [dict(e, run_id=run_id) for e in events]
        out.append([(run_id, wire.prepare_batch(mine[i:i + RECORD]).request.SerializeToString())
                    for i in range(0, len(mine), RECORD)])
    return out


def test_a_crash_before_the_hand_over_counts_a_cluster_once(tmp_path: Path) -> None:
    """Stop 46's G6: the partition holding a cluster was seeded with the cluster as STORED, which after a crash
    already counted the records delivered again -- counted a second time in another run's partition."""
    first, second = _crash_runs(2, tmp_path)
    _drain(tmp_path / "kept", first, 1, 0)
    _drain(tmp_path / "kept", second, 1, 0)
    expected = _tables(tmp_path / "kept")

    _drain(tmp_path / "crashed", first, 1, 0)
    _crashed(tmp_path / "crashed", second)
    _drain(tmp_path / "crashed", [], 4, 0)
    assert _tables(tmp_path / "crashed")["clusters"] == expected["clusters"]
    stores = open_stores(Settings(), tmp_path / "crashed")
    try:
        [cluster] = stores.incidents.list_clusters("scenarios").items
        assert cluster.count == 2 and len(cluster.runs) == 2
    finally:
        stores.close()
