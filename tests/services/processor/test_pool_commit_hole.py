"""hR's (stop 46) F7 probe as a test: a worker SIGKILLed as a chunk is handed to it, serve stopped during the retry
backoff, restarted -> the recorded explosion run still has its one incident (fails at 83980051: none).

The worker is killed as the chunk is STARTED (before it is sent), not as it is collected: a worker killed at collect
time may already have written its answer into the pipe (the compiled engine processes a 50-event chunk in well under
a millisecond), so that round succeeded and the death surfaced only at stop's checkpoint -- a PoolFailed out of
stop(), as its contract says, but not the interleaving this test is about (it failed ~2 runs in 10 that way)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from tests.scenarios.corpus import BY_NAME, retimed
from trainguard import wire
from trainguard_server.processor import pool as poolmod
from trainguard_server.processor.embedded import EmbeddedProcessor
from trainguard_server.queue.sqlite import QUEUE_DB, SqliteQueue
from trainguard_server.storage.sqlite import SqliteEventStore, SqliteIncidentStore, SqliteMetricStore


def _open(d: Path) -> Any:
    return SqliteQueue(d / QUEUE_DB, partitions=4), (SqliteEventStore(d / "e.db"), SqliteMetricStore(d / "m.db"),
                                                     SqliteIncidentStore(d / "i.db"))


def test_a_chunk_whose_worker_died_is_not_committed_by_stop(tmp_path: Path, monkeypatch: Any) -> None:
    events = retimed(BY_NAME["explosion"].events(), time.time_ns() - 10**9)
    run_id, project = events[0]["run_id"], events[0]["project"]
    queue, stores = _open(tmp_path)
    queue.publish(run_id, [wire.prepare_batch(events[a:a + 50]).request.SerializeToString()
                           for a in range(0, len(events), 50)])
    processor = EmbeddedProcessor(queue, *stores, snapshot_every_s=1e9, tick_interval_s=1e15, processor_workers=1)
    start = poolmod.PipelinePool.start
    killed = []

    def dying(self: Any, jobs: Any) -> Any:
        if not killed:
            killed.append(True)
            for worker in self.workers:
                os.kill(worker.process.pid, signal.SIGKILL)
                worker.process.join()
        return start(self, jobs)

    monkeypatch.setattr(poolmod.PipelinePool, "start", dying)
    failed = False
    try:
        processor.run_once(1.0)
    except poolmod.PoolFailed:
        failed = True
    assert killed and (failed or processor.last_round_error), "the round with the dead worker did not fail"
    processor.stop(drain=True, timeout=5.0)  # during the backoff
    for part in (queue, *stores):
        part.close()
    queue, stores = _open(tmp_path)
    again = EmbeddedProcessor(queue, *stores, snapshot_every_s=0.0, tick_interval_s=1e15, processor_workers=1)
    try:
        again.drain(30)
        again.stop(drain=True, timeout=10.0)
        found = [(i.category, i.subtype) for i in stores[2].list_incidents(project, run_id=run_id).items]
    finally:
        for part in (queue, *stores):
            part.close()
    assert found == [BY_NAME["explosion"].expected]
