"""hR2's G1 (stop 46): the worker pool leaves a run out of detection only when it is that run's fault, and
only that run -- keyed by (project, run id), since the queue key is the run id alone and run ids repeat
across projects (Slurm job ids, TRAINGUARD_RUN_ID) -- after its call failed alone twice, each after a fresh
rebuild (a worker killed by something else -- the OOM killer -- blames nobody). The mark shows in /readyz's notes
and /metrics and expires at a checkpoint ``pool_left_out_s`` later. hR2's probe /tmp/hR2/false_quarantine.py
(the tenant and the 'oom 5' cases) made tests: both left out a healthy run before.

SqliteQueue of 4 partitions, 2 workers, SQLite stores; a worker's death is a real SIGKILL."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, Dict, List, Set, Tuple

from tests.scenarios.corpus import BY_NAME, retimed
from trainguard import wire
from trainguard_server.observability import render_prometheus
from trainguard_server.processor import pool as poolmod
from trainguard_server.processor.embedded import EmbeddedProcessor
from trainguard_server.queue.sqlite import QUEUE_DB, SqliteQueue
from trainguard_server.storage.sqlite import SqliteEventStore, SqliteIncidentStore, SqliteMetricStore

EXPLOSION = [("gradient", "explosion")]


def _values(name: str, project: str, run_id: str, tag: str) -> List[bytes]:
    """Scenario ``name`` as ``project``/``run_id``: its batches of 50 events, as the gateway queues them."""
    events = retimed(BY_NAME[name].events(), time.time_ns() - 10**9)
    for e in events:
        e["project"], e["run_id"], e["trace_id"] = project, run_id, run_id
        e["event_id"] = e["event_id"][:24] + tag
    return [wire.prepare_batch(events[a:a + 50]).request.SerializeToString() for a in range(0, len(events), 50)]


def _kill_on(monkeypatch: Any, poison: Set[bytes], first_sends: int) -> None:
    """A worker is SIGKILLed when a call hands it one of ``poison``, and at the first ``first_sends``
    'process' calls whatever they hold (memory pressure)."""
    send = poolmod._Worker.send
    left = [first_sends]

    def dying(self: Any, *message: Any) -> None:
        hit = message[0] == "process" and any((r if isinstance(r, bytes) else r[0]) in poison
                                              for _, records in message[1] for r in records)
        if message[0] == "process" and left[0] > 0:
            left[0] -= 1
            hit = True
        if hit:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.join(10)
        send(self, *message)

    monkeypatch.setattr(poolmod._Worker, "send", dying)


def _drain(root: Path, plan: List[Tuple[str, bytes]], **kwargs: Any) -> Tuple[EmbeddedProcessor, Any]:
    queue = SqliteQueue(root / QUEUE_DB, partitions=4)
    for key, value in plan:
        queue.publish(key, [value])
    stores = (SqliteEventStore(root / "e.db"), SqliteMetricStore(root / "m.db"), SqliteIncidentStore(root / "i.db"))
    processor = EmbeddedProcessor(queue, *stores, snapshot_every_s=1e9, tick_interval_s=1e15,
                                  processor_workers=2, batch=4, round_target_s=0.0, **kwargs)
    try:
        for _ in range(300):
            try:
                if processor.run_once(0.2) == 0 and not processor._retry:
                    break
            except poolmod.PoolFailed:
                processor._retry_at = 0.0  # the backoff skipped (test speed)
        processor.checkpoint()
        assert queue.depth() == 0 and not processor._retry
    except BaseException:
        processor.stop(drain=False)
        raise
    return processor, stores[2]


def _incidents(incidents: Any, project: str, run_id: str) -> List[Tuple[str, str]]:
    return [(i.category, i.subtype) for i in incidents.list_incidents(project, run_id=run_id).items]


class _Services:
    def __init__(self, processor: EmbeddedProcessor) -> None:
        self.processor = processor


def test_another_projects_run_of_the_same_id_is_not_left_out(tmp_path: Path, monkeypatch: Any) -> None:
    poison = _values("healthy_mlp", "A", "slurm-4242", "aaaaaaaa")
    plan = [("slurm-4242", v) for v in poison]
    plan += [("slurm-4242", v) for v in _values("explosion", "B", "slurm-4242", "bbbbbbbb")]
    plan += [("b-other", v) for v in _values("explosion", "B", "b-other", "cccccccc")]
    _kill_on(monkeypatch, set(poison), 0)
    processor, incidents = _drain(tmp_path, plan, pool_left_out_s=3600.0)
    try:
        assert list(processor.poisoned_runs) == [("A", "slurm-4242")]
        assert _incidents(incidents, "B", "slurm-4242") == EXPLOSION  # [] before: B's run left out too
        assert _incidents(incidents, "B", "b-other") == EXPLOSION
        # shown, not unready: /readyz's notes name the project and the run (no 503: one project's run must
        # not take the server out of service for all), /metrics counts it
        notes = processor.notes()
        assert len(notes) == 1 and "'slurm-4242' of project 'A'" in notes[0] and processor.problems() == []
        text = render_prometheus(_Services(processor))
        assert "trainguard_processor_runs_left_out_total 1" in text
        assert 'trainguard_processor_runs_left_out{project="A"} 1' in text
        # and it expires: a checkpoint before the hold keeps it, one after lifts it
        processor.checkpoint()
        assert list(processor.poisoned_runs) == [("A", "slurm-4242")]
        processor.poisoned_runs.hold_s = 0.0
        processor.checkpoint()
        assert not processor.poisoned_runs and processor.notes() == []
        assert "trainguard_processor_runs_left_out_total 1" in render_prometheus(_Services(processor))
    finally:
        processor.stop(drain=False)


def test_a_worker_killed_by_something_else_blames_no_run(tmp_path: Path, monkeypatch: Any) -> None:
    """hR2's 'oom 5': two chunks of two workers killed (isolation starts), then one kill during the per-run
    pass -- that run was left out (its explosion never reported) before the second strike."""
    plan = [("b-one", v) for v in _values("explosion", "B", "b-one", "bbbbbbbb")]
    plan += [("b-other", v) for v in _values("explosion", "B", "b-other", "cccccccc")]
    _kill_on(monkeypatch, set(), 5)
    processor, incidents = _drain(tmp_path, plan)
    try:
        assert processor.pool is not None and processor.pool.rebuilds >= 3
        assert list(processor.poisoned_runs) == []
        assert _incidents(incidents, "B", "b-one") == EXPLOSION
        assert _incidents(incidents, "B", "b-other") == EXPLOSION
    finally:
        processor.stop(drain=False)


def test_a_run_left_out_is_tried_again_after_its_hold(tmp_path: Path, monkeypatch: Any) -> None:
    """A run left out by a cause that passed (its records no longer kill the worker) is detected on again
    after the checkpoint that lifts its mark."""
    first = _values("healthy_mlp", "A", "run-1", "aaaaaaaa")
    poison: Dict[str, Set[bytes]] = {"now": set(first)}
    send = poolmod._Worker.send

    def dying(self: Any, *message: Any) -> None:
        if message[0] == "process" and any((r if isinstance(r, bytes) else r[0]) in poison["now"]
                                           for _, records in message[1] for r in records):
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.join(10)
        send(self, *message)

    monkeypatch.setattr(poolmod._Worker, "send", dying)
    processor, incidents = _drain(tmp_path, [("run-1", v) for v in first], pool_left_out_s=3600.0)
    try:
        assert list(processor.poisoned_runs) == [("A", "run-1")]
        poison["now"] = set()
        processor.poisoned_runs.hold_s = 0.0
        processor.checkpoint()
        assert not processor.poisoned_runs
        for value in _values("explosion", "A", "run-1", "dddddddd"):
            processor.queue.publish("run-1", [value])
        processor.drain(30)
        assert _incidents(incidents, "A", "run-1") == EXPLOSION
    finally:
        processor.stop(drain=False)


def test_a_run_that_hangs_its_worker_is_left_out_with_a_call_timeout(tmp_path: Path, monkeypatch: Any) -> None:
    """hR2's G4: a worker that HANGS on a run's records (SIGSTOPped here, as a detector stuck in a loop) stalled
    every partition, and isolation never saw it (only deaths count). With ``pool_call_timeout_s`` a call past
    it fails as a death does: the hung worker is replaced, the run found and left out, the others go on."""
    poison = _values("healthy_mlp", "A", "stuck", "aaaaaaaa")
    plan = [("stuck", v) for v in poison]
    plan += [("b-other", v) for v in _values("explosion", "B", "b-other", "cccccccc")]
    send = poolmod._Worker.send
    hung: List[int] = []

    def hanging(self: Any, *message: Any) -> None:
        if message[0] == "process" and any((r if isinstance(r, bytes) else r[0]) in set(poison)
                                           for _, records in message[1] for r in records):
            os.kill(self.process.pid, signal.SIGSTOP)
            hung.append(self.process.pid)
        send(self, *message)

    monkeypatch.setattr(poolmod._Worker, "send", hanging)
    processor, incidents = _drain(tmp_path, plan, pool_left_out_s=3600.0, pool_call_timeout_s=1.0)
    try:
        assert list(processor.poisoned_runs) == [("A", "stuck")] and len(hung) >= 2
        assert _incidents(incidents, "B", "b-other") == EXPLOSION
    finally:
        processor.stop(drain=False)  # the hung workers were killed and reaped when replaced
