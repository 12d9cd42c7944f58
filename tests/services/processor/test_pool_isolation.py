"""hR2's G1 (stop 46): the per-run pass (:meth:`PipelinePool.process_runs`) is all or nothing, as a pool call
is. A store read failing in the rebuild before a later run's call (right after the poison run was found)
made the chunk fail while the runs already through it stayed in their pipelines: the chunk's retry was then
a replay for them -- nothing emitted, their incidents lost for good, counters counted twice. hR2's probe
/tmp/hR2/isolation_partial.py ('storefail', the poison run 4th of 7) as a test: incidents and counters equal
to the same pass without the store failure (b0, b2, b3's incidents were [] before)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Dict, List, Tuple

from tests.services.processor.test_pool_left_out import _incidents, _values
from trainguard_server.processor import pool as poolmod
from trainguard_server.processor.embedded import EmbeddedProcessor
from trainguard_server.queue.sqlite import QUEUE_DB, SqliteQueue
from trainguard_server.storage.sqlite import SqliteEventStore, SqliteIncidentStore, SqliteMetricStore

SCENARIOS = ["explosion", "healthy_lm", "vanishing", "plateau", "crash", "leak"]


def _pass(root: Path, monkeypatch: Any, store_fails: bool) -> Tuple[Dict[str, int], Dict[str, List[Any]]]:
    poison = _values("healthy_mlp", "A", "poison", "aaaaaaaa")
    plan: List[Tuple[str, bytes]] = []
    for i, name in enumerate(SCENARIOS):
        if i == 3:  # the per-run pass meets the poison run after some runs, before others
            plan += [("poison", v) for v in poison]
        plan += [(f"b{i}", v) for v in _values(name, "B", f"b{i}", f"bbbbbb{i:02d}")]
    queue = SqliteQueue(root / QUEUE_DB, partitions=4)
    for key, value in plan:
        queue.publish(key, [value])
    stores = (SqliteEventStore(root / "e.db"), SqliteMetricStore(root / "m.db"), SqliteIncidentStore(root / "i.db"))
    processor = EmbeddedProcessor(queue, *stores, snapshot_every_s=1e9, tick_interval_s=1e15,
                                  processor_workers=2, batch=64, round_target_s=0.0)
    state = {"armed": False, "fired": 0}
    send = poolmod._Worker.send

    def dying(self: Any, *message: Any) -> None:
        if message[0] == "process" and any((r if isinstance(r, bytes) else r[0]) in set(poison)
                                           for _, records in message[1] for r in records):
            if store_fails and processor._pool_failures >= processor.pool_isolate_after:
                state["armed"] = True  # the run after it meets the store failure in its rebuild
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.join(10)
        send(self, *message)

    monkeypatch.setattr(poolmod._Worker, "send", dying)
    assert processor.pool is not None
    load = processor.pool._load

    def flaky(partition: int) -> Any:
        if state["armed"] and not state["fired"]:
            state["fired"] += 1
            raise OSError("disk I/O error (the incidents store, once)")
        return load(partition)

    processor.pool._load = flaky
    try:
        for _ in range(300):
            try:
                if processor.run_once(0.2) == 0 and not processor._retry:
                    break
            except Exception:
                processor._retry_at = 0.0  # the backoff skipped (test speed)
        processor.checkpoint()
        assert queue.depth() == 0 and state["fired"] == int(store_fails)
        assert [run for _, run in processor.poisoned_runs] == ["poison"]
        counters = dict(processor.counters)
        found = {f"b{i}": _incidents(stores[2], "B", f"b{i}") for i in range(len(SCENARIOS))}
    finally:
        processor.stop(drain=False)
        monkeypatch.undo()
    return counters, found


def test_a_per_run_pass_failing_part_way_loses_nothing(tmp_path: Path, monkeypatch: Any) -> None:
    plain_counters, plain = _pass(tmp_path / "plain", monkeypatch, False)
    assert plain["b0"] and plain["b2"] and plain["b3"]  # the runs the pass went through first find something
    counters, found = _pass(tmp_path / "storefail", monkeypatch, True)
    assert found == plain
    assert counters == plain_counters
