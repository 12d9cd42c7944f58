"""Partitions of the embedded queues (SQLite, memory; TRAINGUARD_QUEUE_PARTITIONS): a lane's records in partition
lane % P, the one consumer told once that it owns all of them, the SQLite file keeping the count it first had
above 1. The queue contract itself runs over them in test_queue_contract.py (``-p4``)."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple, Union

import pytest

from tests.scenarios.corpus import BY_NAME, retimed
from trainguard import wire
from trainguard_server.config import Settings
from trainguard_server.processor.embedded import EmbeddedProcessor
from trainguard_server.queue import AUTO_PARTITIONS, embedded_partitions, open_queue
from trainguard_server.queue import sqlite as sqlite_queue
from trainguard_server.queue.base import Queue, QueueFull, QueueRecord
from trainguard_server.queue.common import DEFAULT_LANES, lane_of
from trainguard_server.queue.memory import MemoryQueue
from trainguard_server.queue.sqlite import QUEUE_DB, SqliteQueue
from trainguard_server.storage.sqlite import SqliteEventStore, SqliteIncidentStore, SqliteMetricStore

P = 4
KEYS = [f"run-{i}" for i in range(40)]
Embedded = Union[MemoryQueue, SqliteQueue]
OpenEmbedded = Callable[..., Embedded]


@pytest.fixture(params=["memory", "sqlite"])
def open_embedded(request: pytest.FixtureRequest, tmp_path: Path) -> OpenEmbedded:
    opened: List[Embedded] = []

    def open_(**kwargs: int) -> Embedded:
        queue: Embedded
        if request.param == "memory":
            queue = MemoryQueue(**kwargs)
        else:
            queue = SqliteQueue(tmp_path / QUEUE_DB, **kwargs)
        opened.append(queue)
        return queue

    request.addfinalizer(lambda: [q.close() for q in opened])
    return open_


class Recorder:
    """A rebalance listener that writes down what it is told, and on which thread."""

    def __init__(self, fail: int = 0) -> None:
        self.calls: List[Tuple[str, List[int], int]] = []
        self.fail = fail  # raise on this many first assignments

    def partitions_assigned(self, partitions: Sequence[int]) -> None:
        self.calls.append(("assigned", list(partitions), threading.get_ident()))
        if self.fail:
            self.fail -= 1
            raise RuntimeError("listener failed")

    def partitions_revoked(self, partitions: Sequence[int], lost: bool) -> None:
        self.calls.append(("revoked" + (" lost" if lost else ""), list(partitions), threading.get_ident()))


def drain(queue: Queue) -> List[QueueRecord]:
    out: List[QueueRecord] = []
    while True:
        got = queue.consume(1000, 0.1)
        if not got:
            return out
        out += got


def test_each_record_is_in_the_partition_of_its_lane(open_embedded: OpenEmbedded) -> None:
    queue = open_embedded(partitions=P)
    assert queue.partitioned and queue.partitions == P
    for key in KEYS:
        queue.publish(key, [f"{key}:{j}".encode() for j in range(3)])
    records = drain(queue)
    assert len(records) == 3 * len(KEYS)
    for r in records:
        assert r.lane == lane_of(r.key, queue.lanes) and r.partition == r.lane % P
    assert {r.partition for r in records} == set(range(P))  # 40 keys reach every partition
    for key in KEYS:  # a key's records in one partition, in publish order
        assert [r.value for r in records if r.key == key] == [f"{key}:{j}".encode() for j in range(3)]
    queue.commit(records)
    assert queue.depth() == 0


def test_one_partition_is_as_before(open_embedded: OpenEmbedded) -> None:
    queue = open_embedded()
    listener = Recorder()
    queue.set_rebalance_listener(listener)
    for key in KEYS:
        queue.publish(key, [b"x"])
    records = drain(queue)
    assert not queue.partitioned and queue.partitions == 1
    assert {r.partition for r in records} == {0} and listener.calls == []


def test_the_embedded_queues_never_revoke_and_kafka_may(open_embedded: OpenEmbedded) -> None:
    """A processing round may consume again only where a consume cannot revoke partitions it holds
    records of (processor/embedded.py ``_round``): the embedded queues, partitioned or not, never do."""
    from trainguard_server.queue.kafka import KafkaQueue

    assert open_embedded().revokes_partitions is False
    assert open_embedded(partitions=4).revokes_partitions is False
    assert KafkaQueue.revokes_partitions is True


def test_the_listener_is_told_once_on_the_consuming_thread_and_never_revoked(open_embedded: OpenEmbedded) -> None:
    queue = open_embedded(partitions=P)
    listener = Recorder()
    queue.set_rebalance_listener(listener)
    assert listener.calls == []  # not when it is set: at the first consume
    queue.publish("run-a", [b"a"])
    got: List[QueueRecord] = []
    consumer = threading.Thread(target=lambda: got.extend(queue.consume(10, 1.0)))
    consumer.start()
    consumer.join(10)
    assert [r.value for r in got] == [b"a"]
    assert listener.calls == [("assigned", list(range(P)), consumer.ident)]
    queue.commit(got)
    queue.publish("run-b", [b"b"])
    queue.commit(drain(queue))
    queue.close()
    assert len(listener.calls) == 1  # no second assignment, no revocation, not even at close


def test_a_listener_that_fails_is_told_again_and_a_new_one_is_told_too(open_embedded: OpenEmbedded) -> None:
    queue = open_embedded(partitions=P)
    listener = Recorder(fail=1)
    queue.set_rebalance_listener(listener)
    queue.publish("run-a", [b"a"])
    with pytest.raises(RuntimeError):
        queue.consume(10, 0.1)
    assert [r.value for r in queue.consume(10, 0.5)] == [b"a"]  # nothing was taken by the failed call
    assert [c[:2] for c in listener.calls] == [("assigned", list(range(P)))] * 2
    other = Recorder()
    queue.set_rebalance_listener(other)
    queue.consume(10, 0.0)
    assert [c[:2] for c in other.calls] == [("assigned", list(range(P)))]
    queue.set_rebalance_listener(None)
    queue.consume(10, 0.0)
    assert len(listener.calls) == 2 and len(other.calls) == 1


def test_a_commit_naming_another_partition_than_its_lanes_is_a_value_error(open_embedded: OpenEmbedded) -> None:
    queue = open_embedded(partitions=P)
    queue.publish("run-a", [b"a"])
    record = queue.consume(1, 0.5)[0]
    for partition in ((record.partition + 1) % P, P, -1):
        with pytest.raises(ValueError, match="partition"):
            queue.commit([record._replace(partition=partition)])
    assert queue.depth() == 1
    queue.commit([record])
    assert queue.depth() == 0


def test_a_commit_covers_its_lane_in_its_partition_only(open_embedded: OpenEmbedded) -> None:
    queue = open_embedded(partitions=P)
    by_partition: Dict[int, str] = {}
    for key in KEYS:
        by_partition.setdefault(lane_of(key, queue.lanes) % P, key)
    keys = [by_partition[p] for p in range(P)]
    for key in keys:
        queue.publish(key, [f"{key}:{j}".encode() for j in range(3)])
    first = queue.consume(P, 0.5)  # one record of each partition's key
    assert sorted(r.partition for r in first) == list(range(P))
    queue.commit([first[-1]._replace(offset=first[-1].offset + 2)])  # its whole lane, committed unseen
    assert queue.depth() == 3 * P - 3
    rest = drain(queue)
    assert {r.key for r in rest} == set(keys) - {first[-1].key}
    assert len(rest) == 2 * (P - 1)


# --- the SQLite file keeps its partition count ------------------------------------------------------------
def _meta(path: Path) -> List[Tuple[str, str]]:
    """The file's meta rows but its id (queue_id: every file has one), sorted."""
    conn = sqlite3.connect(str(path))
    try:
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'meta'").fetchone():
            return []
        return sorted((str(n), str(v)) for n, v in conn.execute("SELECT name, value FROM meta")
                      if n != "queue_id")
    finally:
        conn.close()


def _fixed(partitions: int, lanes: int = DEFAULT_LANES) -> List[Tuple[str, str]]:
    """The meta rows of a file partitioned at ``partitions`` over ``lanes`` lanes."""
    return [("lanes", str(lanes)), ("partitions", str(partitions))]


def test_the_file_keeps_the_count_it_first_had_above_one(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / QUEUE_DB
    queue = SqliteQueue(path, partitions=P)
    queue.publish("run-a", [b"a0", b"a1"])
    queue.publish("run-b", [b"b0"])
    first = {r.value: r for r in drain(queue)}
    queue.commit([first[b"a0"]])
    queue.close()
    assert _meta(path) == _fixed(P)
    for asked in (8, 1):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trainguard.queue.sqlite"):
            queue = SqliteQueue(path, partitions=asked)
        assert queue.partitions == P and queue.partitioned
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == 1 and f"holds {P} partitions" in warned[0] and f"the {asked} asked" in warned[0]
        again = {r.value: r for r in drain(queue)}  # redelivered: in the partitions they had
        assert sorted(again) == [b"a1", b"b0"]
        assert all(again[v].partition == first[v].partition for v in again)
        queue.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainguard.queue.sqlite"):
        SqliteQueue(path, partitions=P).close()
    assert caplog.records == [] and _meta(path) == _fixed(P)


def test_a_file_of_one_partition_is_left_as_it_is_until_opened_with_more(tmp_path: Path) -> None:
    path = tmp_path / QUEUE_DB
    queue = SqliteQueue(path)
    queue.publish("run-a", [b"a0"])
    queue.close()
    assert _meta(path) == []  # a file of one partition fixes no count (its id only)
    queue = SqliteQueue(path, partitions=1, lanes=64)  # its lanes may change between starts
    assert queue.lanes == 64
    queue.close()
    assert _meta(path) == []
    queue = SqliteQueue(path, partitions=P)  # an older file, now partitioned: its records keep their lanes
    assert queue.partitions == P and _meta(path) == _fixed(P)
    [record] = drain(queue)
    assert record.value == b"a0" and record.partition == lane_of("run-a", queue.lanes) % P
    queue.close()


def test_the_lanes_are_fixed_with_the_partitions(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A run's partition is its lane modulo the partitions: a later queue_lanes would move runs to a partition
    whose detection state does not know them (their incidents reported again: hR F9), so the lane count is
    stored with the partition count and kept, with a warning."""
    path = tmp_path / QUEUE_DB
    queue = SqliteQueue(path, lanes=997, partitions=P)
    queue.publish("run-a", [b"a0"])
    [before] = drain(queue)
    queue.close()
    assert _meta(path) == _fixed(P, 997)
    with caplog.at_level(logging.WARNING, logger="trainguard.queue.sqlite"):
        queue = SqliteQueue(path, lanes=1001, partitions=P)
    assert queue.lanes == 997 and [r.getMessage() for r in caplog.records if "997 lanes" in r.getMessage()]
    [after] = drain(queue)
    assert (after.lane, after.partition) == (before.lane, before.partition) == (lane_of("run-a", 997),
                                                                               lane_of("run-a", 997) % P)
    queue.close()


def test_each_file_has_its_own_id_kept_across_opens(tmp_path: Path) -> None:
    """Queue.identity: what a processor saves with the offsets its snapshot covers (hR F1: a file moved
    aside numbers its records from 1 again)."""
    first = SqliteQueue(tmp_path / "a.db")
    ident = first.identity
    first.close()
    again = SqliteQueue(tmp_path / "a.db", partitions=P)
    other = SqliteQueue(tmp_path / "b.db")
    assert len(ident) == 32 and again.identity == ident and other.identity not in ("", ident)
    assert MemoryQueue().identity != MemoryQueue().identity
    again.close()
    other.close()


@pytest.mark.parametrize("asked", [(P, P), (P, 8)], ids=["same", "different"])
def test_processes_opening_a_new_file_at_once_agree(tmp_path: Path, asked: Tuple[int, int]) -> None:
    """Two handles (as two processes: their own connections) opening a new file together: neither fails
    (hR F5: check-then-insert lost a race 1 in 40 with a UNIQUE error), both read one count and one id."""
    for trial in range(12):
        opened, failed = _open_together(tmp_path / f"q{trial}.db", asked)
        assert failed == []
        assert len({q.partitions for q in opened}) == 1 and len({q.identity for q in opened}) == 1
        for q in opened:
            q.close()


def _open_together(path: Path, asked: Tuple[int, ...]) -> Tuple[List[SqliteQueue], List[BaseException]]:
    """One SqliteQueue per count in ``asked`` on ``path``, opened by as many threads at once."""
    barrier = threading.Barrier(len(asked))
    opened: List[SqliteQueue] = []
    failed: List[BaseException] = []

    def open_(partitions: int) -> None:
        barrier.wait()
        try:
            opened.append(SqliteQueue(path, partitions=partitions))
        except BaseException as exc:  # the failure is the finding
            failed.append(exc)

    threads = [threading.Thread(target=open_, args=(n,)) for n in asked]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return opened, failed


def test_a_handle_that_does_not_consume_sees_another_process_commit(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway beside a processor in another process (hR F4): its depth counted only its own publishes, so
    at max_depth it refused every publish though the processor had emptied the file."""
    monkeypatch.setattr(sqlite_queue, "RECOUNT_EVERY_S", 0.0)
    gateway = SqliteQueue(tmp_path / QUEUE_DB, max_depth=10, partitions=P)
    processor = SqliteQueue(tmp_path / QUEUE_DB, max_depth=10, partitions=P)
    gateway.publish("run-a", [b"x"] * 10)
    processor.commit(drain(processor))
    assert processor.depth() == 0 and gateway.depth() == 0
    assert len(gateway.publish("run-a", [b"y"])) == 1  # was QueueFull
    monkeypatch.setattr(sqlite_queue, "RECOUNT_EVERY_S", 3600.0)  # no recount: the kept count, as before
    gateway.publish("run-a", [b"z"] * 9)
    processor.commit(drain(processor))
    with pytest.raises(QueueFull):
        gateway.publish("run-a", [b"w"])
    gateway.close()
    processor.close()


@pytest.mark.parametrize("partitions, workers, expected", [
    (0, 0, 1), (0, 3, AUTO_PARTITIONS), (4, 0, 4), (4, 3, 4), (1, 3, 1)])
def test_open_queue_asks_for_the_settings_partitions(tmp_path: Path, partitions: int, workers: int,
                                                     expected: int) -> None:
    settings = Settings(data_dir=tmp_path, queue_partitions=partitions, processor_workers=workers)
    assert embedded_partitions(settings) == expected
    queue = open_queue(settings, tmp_path)
    assert isinstance(queue, SqliteQueue)
    try:
        assert queue.partitions == expected and queue.partitioned == (expected > 1)
    finally:
        queue.close()


def test_partitions_must_be_a_positive_integer(tmp_path: Path) -> None:
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="partitions"):
            MemoryQueue(partitions=bad)
        with pytest.raises(ValueError, match="partitions"):
            SqliteQueue(tmp_path / QUEUE_DB, partitions=bad)


# --- a data directory whose queue turns partitioned (processor_workers set: auto 16) ----------------------
@pytest.mark.parametrize("before, after", [(1, 1), (P, P), (1, P)])
def test_a_run_in_flight_across_a_restart_keeps_its_one_verdict(tmp_path: Path, before: int, after: int) -> None:
    """The recorded explosion run, its first 200 envelopes (the explosion among them) processed and
    checkpointed over a queue of ``before`` partitions, the rest after a restart over ``after``: one
    incident, as one pipeline over the whole run reports."""
    events = retimed(BY_NAME["explosion"].events(), time.time_ns() - 10**9)
    run_id, project = events[0]["run_id"], events[0]["project"]
    for partitions, part in ((before, events[:200]), (after, events[200:])):
        queue = SqliteQueue(tmp_path / QUEUE_DB, partitions=partitions)
        stores = (SqliteEventStore(tmp_path / "events.db"), SqliteMetricStore(tmp_path / "metrics.db"),
                  SqliteIncidentStore(tmp_path / "incidents.db"))
        try:
            queue.publish(run_id, [wire.prepare_batch(part[at:at + 50]).request.SerializeToString()
                                   for at in range(0, len(part), 50)])
            processor = EmbeddedProcessor(queue, *stores, snapshot_every_s=0.0, tick_interval_s=1e15)
            processor.drain(30)
            processor.checkpoint()
            found = [(i.category, i.subtype) for i in stores[2].list_incidents(project, run_id=run_id).items]
            assert queue.depth() == 0 and queue.partitions == max(before, partitions)
        finally:
            for closing in (queue, *stores):
                closing.close()
    assert found == [BY_NAME["explosion"].expected]
