"""Issue 15: the pipelines of a partitioned queue in worker processes (processor/pool.py) leave exactly what
the in-thread pipelines leave.

The same records -- the scenario corpus (real trainings as the SDK sent them) and several runs of
bench/processor.py's sdk16 and env500 shapes, published interleaved so a chunk holds many partitions --
are processed over a partitioned in-memory queue by a processor with ``processor_workers`` 0 (the pipelines
in its thread), 1 and 2, with the same checkpoints and the same (fake) clock ticking the pipelines every
round; every SQLite store's tables (bench/processor_digest.py's digests: records, incidents, snapshot parts,
points, raw context), the records emitted to the listeners and the summed counters must be equal. A worker
killed (SIGKILL) mid-stream, between a checkpoint and the next, makes one round fail; the pool restarts it,
rebuilds the partitions from the snapshot and the calls since, and the final stores are those of the
uninterrupted run. No worker outlives ``stop``.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import types
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import pytest

from tests.scenarios.corpus import SCENARIOS
from trainguard import wire
from trainguard_engine.catalogue import DetectionSettings
from trainguard_server.config import Settings
from trainguard_server.processor import embedded
from trainguard_server.processor.embedded import EmbeddedProcessor
from trainguard_server.processor.pool import PoolFailed
from trainguard_server.queue.base import Queue, QueueRecord, RebalanceListener
from trainguard_server.queue.common import lane_of
from trainguard_server.storage.select import open_stores

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))
try:
    import processor as bench  # bench/processor.py: the streams
    from processor_digest import STORE_FILES, table_digests  # bench/processor_digest.py
finally:
    sys.path.remove(str(REPO / "bench"))

PARTITIONS = 4
LANES = 64
RECORD = 50  # corpus envelopes per record


class PartitionedQueue(Queue):
    """A partitioned queue in memory (what hQ's embedded queues present): a key's records in lane
    ``lane_of(key)``, partition ``lane % partitions``; handed out in publish order; the listener told of
    every partition at the first consume; ``revokes``: whether the processor must assume a later consume
    may revoke partitions (Kafka: one consume per round) or not (the embedded queues: rounds filled)."""

    partitioned = True

    def __init__(self, partitions: int = PARTITIONS, lanes: int = LANES, revokes: bool = False) -> None:
        self.revokes_partitions = revokes
        self.partitions = partitions
        self.lanes = lanes
        self._records: List[QueueRecord] = []
        self._next = 0
        self._done: Set[Tuple[int, int]] = set()
        self._listener: Optional[RebalanceListener] = None
        self._told = False

    def set_rebalance_listener(self, listener: Optional[RebalanceListener]) -> None:
        self._listener = listener

    def publish(self, key: str, values: Sequence[bytes]) -> List[int]:
        lane = lane_of(key, self.lanes)
        out = []
        for value in values:
            offset = len(self._records)
            self._records.append(QueueRecord(lane % self.partitions, offset, key, value, 0, lane))
            out.append(offset)
        return out

    def consume(self, max_records: int, timeout: float) -> List[QueueRecord]:
        if not self._told and self._listener is not None:
            self._told = True
            self._listener.partitions_assigned(range(self.partitions))
        out = self._records[self._next:self._next + max_records]
        self._next += len(out)
        return out

    def commit(self, records: Sequence[QueueRecord]) -> None:
        self._done.update((r.lane, r.offset) for r in records)

    def reopen(self) -> PartitionedQueue:
        """The queue as a restarted processor finds it: what is not committed handed out again."""
        again = PartitionedQueue(self.partitions, self.lanes, self.revokes_partitions)
        again._records = self._records
        again._done = self._done
        again._next = min((i for i, r in enumerate(self._records) if (r.lane, r.offset) not in self._done),
                          default=len(self._records))
        return again

    def depth(self) -> int:
        return len(self._records) - len(self._done)


class StoreAway(Exception):
    """A store write that fails (the round is retried)."""


class Clock:
    """embedded.py's ``time`` with ``time_ns`` set by the test (the pipelines' ticks: deterministic)."""

    def __init__(self, now_ns: int) -> None:
        self.now_ns = now_ns

    def module(self) -> Any:
        import time

        fake = types.SimpleNamespace(**{name: getattr(time, name) for name in
                                        ("monotonic", "perf_counter", "sleep", "time")})
        fake.time_ns = lambda: self.now_ns
        return fake


def _interleaved(runs: Sequence[Tuple[str, List[bytes]]]) -> List[Tuple[str, bytes]]:
    """Every run's records, one of each run in turn (so a chunk holds many runs, so many partitions)."""
    out: List[Tuple[str, bytes]] = []
    for i in range(max(len(values) for _key, values in runs)):
        out.extend((key, values[i]) for key, values in runs if i < len(values))
    return out


def corpus_stream() -> List[Tuple[str, bytes]]:
    runs = []
    for scenario in SCENARIOS:
        events = scenario.events()
        runs.append((str(events[0]["run_id"]), [wire.prepare_batch(events[i:i + RECORD]).request
                                                .SerializeToString() for i in range(0, len(events), RECORD)]))
    return _interleaved(runs)


def bench_stream(shape: str, runs: int) -> List[Tuple[str, bytes]]:
    """``runs`` runs of a bench/processor.py shape (shortened: sdk 16 ranks x 40 steps, env500 12 records)."""
    out = []
    for r in range(runs):
        run_id = f"pool-{shape}-{r}"
        batches: Iterable[Any] = (bench.sdk_requests("bench", run_id, 16, 40) if shape == "sdk16"
                                  else bench.env500_requests("bench", run_id, 12))
        out.append((run_id, [wire.prepare_batch(b).request.SerializeToString() for b in batches]))
    return _interleaved(out)


def _time_after(stream: Sequence[Tuple[str, bytes]]) -> int:
    from trainguard_server.processor.decode import read_request

    latest = 0
    for _key, value in stream:
        for env in read_request(value)[0]:
            t = env.time_ns if hasattr(env, "time_ns") else int(env.get("time_unix_nano", 0))
            latest = max(latest, int(t))
    return latest + 1_000_000_000


def run_stream(stream: Sequence[Tuple[str, bytes]], root: Path, workers: int, monkeypatch: Any, *,
               batch: int = 16, checkpoint_every: int = 5, kill_after: Optional[int] = None,
               store_away_after: Optional[int] = None, revokes: bool = False) -> Dict[str, str]:
    """Process ``stream`` round by round (a tick each round at a clock one second further; a checkpoint
    every ``checkpoint_every`` rounds; with ``kill_after``, worker 0 killed after that many rounds; with
    ``store_away_after``, the metric store's next write after that many rounds fails once) and return the
    digests of what was left: every store table, the emitted records, the counters."""
    start = _time_after(stream)
    clock = Clock(start)
    monkeypatch.setattr(embedded, "time", clock.module())
    root.mkdir(parents=True)
    queue = PartitionedQueue(revokes=revokes)
    for key, value in stream:
        queue.publish(key, [value])
    stores = open_stores(Settings(), root)
    processor = EmbeddedProcessor(queue, stores.events, stores.metrics, stores.incidents,
                                  DetectionSettings.from_overrides({"stall_min_s": 5.0}), batch=batch,
                                  snapshot_every_s=1e12, tick_interval_s=0.0, round_target_s=0.0,
                                  processor_workers=workers)
    emitted = hashlib.sha256()
    count = [0]

    def listener(output: Any) -> None:
        for record in (*output.runs, *output.incidents, *output.clusters):
            emitted.update(repr(record).encode())
            count[0] += 1

    processor.listeners.append(listener)
    rounds = failures = 0
    put_columns = stores.metrics.put_columns

    def flaky_put(columns: Any) -> None:
        if store_away_after is not None and rounds == store_away_after and not failures:
            raise StoreAway("metric store unavailable (test)")
        put_columns(columns)

    monkeypatch.setattr(stores.metrics, "put_columns", flaky_put)
    pids = [w.process.pid for w in processor.pool.workers] if processor.pool is not None else []
    try:
        while queue.depth() and failures < 20:
            if kill_after is not None and rounds == kill_after and not failures:
                assert processor.pool is not None
                os.kill(processor.pool.workers[0].process.pid, signal.SIGKILL)
                processor.pool.workers[0].process.join(10)
            try:
                clock.now_ns = start + (rounds + 1) * 1_000_000_000  # a failed round's retry: the same
                done = processor.run_once(timeout=0.5)
            except (PoolFailed, StoreAway):
                failures += 1
                continue
            if done:
                rounds += 1
                if rounds % checkpoint_every == 0:
                    processor.checkpoint()
            elif not processor._retry and not processor._pending and queue._next == len(queue._records):
                processor.checkpoint()
        counters = processor.counters
        rebuilds = processor.pool.rebuilds if processor.pool is not None else 0
        live = processor.pool.workers if processor.pool is not None else []
    finally:
        processor.stop(drain=False)
    assert all(not w.process.is_alive() for w in live), "a worker outlived stop()"
    for pid in pids:  # reaped: no zombie left (the killed one included)
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    stores.close()
    assert queue.depth() == 0
    if kill_after is not None or (store_away_after is not None and workers):
        assert failures >= 1 and rebuilds >= 1, (failures, rebuilds)
    out = {"emitted": f"{emitted.hexdigest()} records={count[0]}", "counters": repr(sorted(counters.items()))}
    for name in STORE_FILES:
        if (root / name).exists():
            for table, digest in table_digests(root / name).items():
                out[f"{name}:{table}"] = digest
    return out


STREAMS = {"corpus": corpus_stream, "sdk16": lambda: bench_stream("sdk16", 6),
           "env500": lambda: bench_stream("env500", 6)}


@pytest.mark.parametrize("name,revokes", [("corpus", False), ("corpus", True), ("sdk16", False),
                                          ("env500", True)])
def test_workers_leave_what_the_thread_leaves(name: str, revokes: bool, tmp_path: Path,
                                              monkeypatch: Any) -> None:
    stream = STREAMS[name]()
    batch = 4 if name == "env500" else 16
    expected = run_stream(stream, tmp_path / "w0", 0, monkeypatch, batch=batch, revokes=revokes)
    assert "incidents" in " ".join(expected) and int(expected["emitted"].split("=")[1]) > 0
    for workers in (1, 2):
        got = run_stream(stream, tmp_path / f"w{workers}", workers, monkeypatch, batch=batch, revokes=revokes)
        assert got == expected, workers


def test_killed_worker_is_rebuilt_exactly(tmp_path: Path, monkeypatch: Any) -> None:
    stream = bench_stream("sdk16", 6)
    # one consume of 16 records a round (a queue that may revoke partitions): many rounds to kill between
    expected = run_stream(stream, tmp_path / "w0", 0, monkeypatch, checkpoint_every=4, revokes=True)
    got = run_stream(stream, tmp_path / "killed", 2, monkeypatch, checkpoint_every=4, kill_after=6,
                     revokes=True)
    assert got == expected


def test_store_failure_while_workers_run_is_retried_exactly(tmp_path: Path, monkeypatch: Any) -> None:
    """The workers get a chunk before its raw context and points are stored: when that store write fails,
    the chunk's outputs are dropped and its pipelines rebuilt without it before the retry."""
    stream = bench_stream("sdk16", 4)
    expected = run_stream(stream, tmp_path / "w0", 0, monkeypatch, checkpoint_every=3, revokes=True)
    got = run_stream(stream, tmp_path / "away", 2, monkeypatch, checkpoint_every=3, store_away_after=4,
                     revokes=True)
    assert got == expected


def test_stop_after_a_worker_death_commits_only_what_a_pipeline_saw(tmp_path: Path) -> None:
    """hR's F7: a worker dies while a chunk is collected; ``stop`` during the retry's backoff checkpoints --
    the failed chunk's records must stay uncommitted (processed after a restart), so every run ends with
    the incidents of an uninterrupted drain."""
    stream = corpus_stream()
    settings = DetectionSettings.from_overrides({"stall_min_s": 5.0})

    def processor(queue: PartitionedQueue, root: Path, workers: int) -> Tuple[EmbeddedProcessor, Any]:
        stores = open_stores(Settings(), root)
        return EmbeddedProcessor(queue, stores.events, stores.metrics, stores.incidents, settings, batch=16,
                                 snapshot_every_s=1e12, tick_interval_s=1e12, round_target_s=0.0,
                                 processor_workers=workers), stores

    def incidents(root: Path) -> Tuple[str, str]:
        tables = table_digests(root / "incidents.db")
        return tables["incidents"], tables["runs"]

    queue = PartitionedQueue(revokes=True)
    for key, value in stream:
        queue.publish(key, [value])
    plain, plain_stores = processor(queue, tmp_path / "plain", 0)
    plain.stop(drain=True, timeout=60)
    plain_stores.close()
    expected = incidents(tmp_path / "plain")
    assert "rows=0" not in expected[0]

    queue = PartitionedQueue(revokes=True)
    for key, value in stream:
        queue.publish(key, [value])
    first, stores = processor(queue, tmp_path / "pooled", 1)
    assert first.pool is not None
    for _ in range(3):
        first.run_once(timeout=0.0)
    os.kill(first.pool.workers[0].process.pid or 0, signal.SIGKILL)
    first.pool.workers[0].process.join(10)
    with pytest.raises(PoolFailed):
        first.run_once(timeout=0.0)
    failed = list(first._retry)
    assert failed
    first.stop(drain=True, timeout=5)  # the backoff ends the drain at once; the checkpoint commits
    assert not any((r.lane, r.offset) in queue._done for r in failed), "committed records no pipeline saw"
    stores.close()

    again, stores = processor(queue.reopen(), tmp_path / "pooled", 1)
    again.stop(drain=True, timeout=60)
    assert again.queue.depth() == 0
    stores.close()
    assert incidents(tmp_path / "pooled") == expected
