"""hR's F8 (stop 46): a run whose records end the pipeline worker every time (its state grown past memory, a
bug it triggers) must not stop every other run. After ``pool_isolate_after`` failed chunks the next runs one
run at a time: the run is found, left out (its records stored, not detected on) and named, and the other runs
end with the incidents they have without it.

The worker's death is made real (SIGKILL) whenever a call hands it one of the poison run's records."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Dict, List, Set, Tuple

from tests.services.processor.test_pool_exact import PartitionedQueue, corpus_stream, table_digests
from trainguard_engine.catalogue import DetectionSettings
from trainguard_server.config import Settings
from trainguard_server.processor import pool as poolmod
from trainguard_server.processor.embedded import EmbeddedProcessor
from trainguard_server.processor.pool import PoolFailed
from trainguard_server.storage.select import open_stores

SETTINGS = DetectionSettings.from_overrides({"stall_min_s": 5.0})


def _drain(root: Path, stream: List[Tuple[str, bytes]], workers: int) -> Tuple[Dict[str, str], EmbeddedProcessor]:
    queue = PartitionedQueue(revokes=True)
    for key, value in stream:
        queue.publish(key, [value])
    stores = open_stores(Settings(), root)
    processor = EmbeddedProcessor(queue, stores.events, stores.metrics, stores.incidents, SETTINGS, batch=16,
                                  snapshot_every_s=1e12, tick_interval_s=1e12, round_target_s=0.0,
                                  processor_workers=workers)
    try:
        for _ in range(400):
            if not queue.depth() and not processor._retry:
                break
            try:
                processor.run_once(timeout=0.5)
            except PoolFailed:
                pass
            if not processor._retry and queue._next == len(queue._records):
                processor.checkpoint()
    finally:
        processor.stop(drain=False)
        stores.close()
    assert queue.depth() == 0
    digests = table_digests(root / "incidents.db")
    return {t: digests[t] for t in ("incidents", "runs")}, processor


def test_a_run_that_kills_its_worker_is_left_out_and_the_rest_go_on(tmp_path: Path, monkeypatch: Any) -> None:
    stream = corpus_stream()
    poison = stream[0][0]
    values: Set[bytes] = {v for k, v in stream if k == poison}
    send = poolmod._Worker.send

    def dying(self: Any, *message: Any) -> None:
        if message[0] == "process" and any((r if isinstance(r, bytes) else r[0]) in values
                                           for _, records in message[1] for r in records):
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.join(10)
        send(self, *message)

    others = [(k, v) for k, v in stream if k != poison]
    without, _ = _drain(tmp_path / "without", others, 0)  # what the other runs end with
    monkeypatch.setattr(poolmod._Worker, "send", dying)
    got, processor = _drain(tmp_path / "poisoned", stream, 2)
    assert [run for _, run in processor.poisoned_runs] == [poison]  # (project, run id)
    assert processor.pool is not None and processor.pool.rebuilds >= 2
    assert got == without  # its records never reached a pipeline: no run record, no incident of its own
