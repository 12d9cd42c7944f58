"""SqliteQueue beyond the contract: a publisher SIGKILLed mid-stream loses no acknowledged record, a
consumer SIGKILLed before committing gets its records again, and the file is laid out as documented."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Dict, List

from tests.services.killing import run_until_killed
from trainguard_server.queue.base import QueueRecord
from trainguard_server.queue.sqlite import PAGE_SIZE, QUEUE_DB, SqliteQueue


def test_acknowledged_publishes_survive_kill_9_mid_stream(tmp_path: Path) -> None:
    path = tmp_path / QUEUE_DB
    code = f"""
        import os
        from trainguard_server.queue.sqlite import SqliteQueue
        queue = SqliteQueue({str(path)!r}, max_depth=10**9)
        filler = os.urandom(20_000)
        i = 0
        while True:
            offsets = queue.publish(f"run-{{i % 3}}", [f"{{i}}:".encode() + filler, f"{{i}}:tail".encode()])
            print(f"done {{i}} {{offsets[0]}} {{offsets[1]}}", flush=True)
            i += 1
    """
    acked = [tuple(int(x) for x in line.split()) for line in run_until_killed(code, acks=300)]
    assert len(acked) >= 300
    queue = SqliteQueue(path)
    try:
        records = []
        while True:
            batch = queue.consume(500, 0.1)
            if not batch:
                break
            records += batch
        by_offset = {r.offset: r for r in records}
        for i, first, second in acked:
            assert by_offset[first].value.startswith(f"{i}:".encode()) and by_offset[first].key == f"run-{i % 3}"
            assert by_offset[second].value == f"{i}:tail".encode()
        offsets = [r.offset for r in records]
        assert len(set(offsets)) == len(offsets)
        for key in ("run-0", "run-1", "run-2"):  # handed out round-robin over the runs, each in order
            mine = [r.offset for r in records if r.key == key]
            assert mine == sorted(mine)
        assert len(records) in (2 * len(acked), 2 * len(acked) + 2)  # at most the batch not yet acknowledged
        assert queue.depth() == len(records)
    finally:
        queue.close()


def test_records_a_killed_consumer_did_not_commit_are_handed_out_again(tmp_path: Path) -> None:
    path = tmp_path / QUEUE_DB
    code = f"""
        import time
        from trainguard_server.queue.sqlite import SqliteQueue
        queue = SqliteQueue({str(path)!r})
        queue.publish("k", [str(i).encode() for i in range(100)])
        records = queue.consume(100, 1.0)
        assert len(records) == 100
        queue.commit(records[:40])
        print("done committed 40", flush=True)
        time.sleep(60)
    """
    run_until_killed(code, acks=1)
    queue = SqliteQueue(path)
    try:
        assert queue.depth() == 60
        records = queue.consume(1000, 0.5)
        assert [r.value for r in records] == [str(i).encode() for i in range(40, 100)]
    finally:
        queue.close()


def test_queue_file_layout(tmp_path: Path) -> None:
    queue = SqliteQueue(tmp_path / QUEUE_DB)
    queue.publish("k", [b"x"])
    queue.close()
    conn = sqlite3.connect(tmp_path / QUEUE_DB)
    assert conn.execute("PRAGMA page_size").fetchone()[0] == PAGE_SIZE
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


def test_a_publish_from_another_process_reaches_a_waiting_consumer(tmp_path: Path) -> None:
    path = tmp_path / QUEUE_DB
    queue = SqliteQueue(path, poll_interval=0.05)
    other = SqliteQueue(path)  # stands in for another process: it cannot notify our Condition
    try:
        got: List[bytes] = []
        thread = threading.Thread(target=lambda: got.extend(r.value for r in queue.consume(10, 10.0)))
        thread.start()
        other.publish("k", [b"from elsewhere"])
        thread.join(10)
        assert got == [b"from elsewhere"]
    finally:
        other.close()
        queue.close()


def test_lanes_are_not_stored_a_file_opens_with_another_lane_count(tmp_path: Path) -> None:
    """Lanes are computed from the keys when a record is first read (the file keeps the schema of the queue
    before lanes): a file written with one lane count -- or by a version without lanes, the same table --
    opens with another, every key's records still in publish order and commits still per lane."""
    path = tmp_path / QUEUE_DB
    conn = sqlite3.connect(path)  # a file as the queue before lanes left it: one uncommitted backlog
    conn.execute('CREATE TABLE records ("offset" INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL, '
                 "value BLOB NOT NULL, published_ns INTEGER NOT NULL)")
    conn.executemany("INSERT INTO records (key, value, published_ns) VALUES (?, ?, 1)",
                     [(f"run-{i % 4}", f"{i}".encode()) for i in range(40)])
    conn.commit()
    conn.close()
    for lanes in (1, 64, 1024):
        queue = SqliteQueue(path, lanes=lanes)
        try:
            assert queue.depth() == 40 - (lanes > 1) * 4  # the first pass committed one record per run
            records = []
            while batch := queue.consume(3, 0.05):
                records += batch
            for key in (f"run-{k}" for k in range(4)):
                mine = [int(r.value) for r in records if r.key == key]
                assert mine == sorted(mine) and len(mine) == (10 if lanes == 1 else 9)
            if lanes == 1:  # one lane: the old order, offset by offset
                assert [int(r.value) for r in records] == list(range(40))
                first: Dict[str, QueueRecord] = {}
                for r in records:
                    first.setdefault(r.key, r)
                queue.commit(list(first.values()))  # each run's first record; the rest stays
        finally:
            queue.close()


def test_a_commit_deletes_each_lanes_records_in_ranges(tmp_path: Path) -> None:
    path = tmp_path / QUEUE_DB
    queue = SqliteQueue(path)
    try:
        for i in range(50):
            queue.publish("noisy", [f"n{i}".encode()])
            if i % 10 == 0:
                queue.publish("quiet", [f"q{i}".encode()])
        records = []
        while batch := queue.consume(7, 0.05):
            records += batch
        assert queue.depth() == 55
        queue.commit([r for r in records if r.key == "noisy"])
        assert queue.depth() == 5
        left = sqlite3.connect(path).execute("SELECT value FROM records ORDER BY \"offset\"").fetchall()
        assert [bytes(v) for (v,) in left] == [f"q{i}".encode() for i in range(0, 50, 10)]
    finally:
        queue.close()


def test_commit_does_not_rewrite_a_records_pages_as_zeros(tmp_path: Path) -> None:
    """A commit deletes its records without writing their pages again as zeros (SECURE_DELETE OFF, on
    both connections, whatever the SQLite build's default): on a SQLite built with secure delete ON
    (Debian's) the DELETE wrote every page of the record into the WAL once more -- a 1 MB record, 1 MB of
    WAL frames -- now only the few b-tree and free-list pages it changes. The record's row is gone
    either way."""
    queue = SqliteQueue(tmp_path / QUEUE_DB)
    try:
        for conn in (queue._writer, queue._reader):
            assert conn.execute("PRAGMA secure_delete").fetchone()[0] == 0
        value = bytes(range(256)) * 4096  # 1 MiB: ~64 overflow pages of 16 KiB
        queue.publish("run-a", [value])
        records = queue.consume(1, 0.1)
        assert [r.value for r in records] == [value]
        wal = tmp_path / (QUEUE_DB + "-wal")
        queue._writer.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        assert wal.stat().st_size == 0
        queue.commit(records)
        assert wal.stat().st_size < len(value) // 4  # a few pages, not the record's 64
        assert queue.depth() == 0
        assert queue.consume(1, 0.0) == []
    finally:
        queue.close()


def _deletes(queue: SqliteQueue) -> List[str]:
    """The DELETE statements the queue's writer runs from now on."""
    seen: List[str] = []
    queue._writer.set_trace_callback(lambda sql: seen.append(sql) if sql.startswith("DELETE") else None)
    return seen


def test_a_commit_of_every_record_empties_the_table_whole(tmp_path: Path) -> None:
    """A commit whose one range holds every record of the file (a drained queue's checkpoint) empties the
    table with one unfiltered DELETE (SQLite's truncate optimization: pages freed whole, not row by row);
    the depth, the rows left (none) and the offsets of later publishes are those of a range delete."""
    queue = SqliteQueue(tmp_path / QUEUE_DB)
    try:
        queue.publish("run-a", [f"a{i}".encode() for i in range(20)])
        queue.publish("run-b", [f"b{i}".encode() for i in range(20)])
        records = []
        while batch := queue.consume(9, 0.05):
            records += batch
        deletes = _deletes(queue)
        queue.commit(records)
        assert deletes == ["DELETE FROM records"]
        assert queue.depth() == 0
        assert queue._writer.execute("SELECT COUNT(*) FROM records").fetchone()[0] == 0
        assert queue.publish("run-a", [b"next"]) == [41]  # AUTOINCREMENT: offsets are never reused
    finally:
        queue.close()


def test_a_commit_that_leaves_records_deletes_its_range_only(tmp_path: Path) -> None:
    """Records outside the committed range -- published after the take (above it) or of another run
    (below it) -- stay: the range delete, never the whole table."""
    path = tmp_path / QUEUE_DB
    queue = SqliteQueue(path)
    try:
        queue.publish("run-b", [b"b0"])  # offset 1: below run-a's records
        queue.publish("run-a", [f"a{i}".encode() for i in range(10)])
        records = [r for r in queue.consume(20, 0.05) if r.key == "run-a"]
        queue.publish("run-a", [b"later"])  # offset 12: above the committed range
        deletes = _deletes(queue)
        queue.commit(records)
        assert deletes == ['DELETE FROM records WHERE "offset" BETWEEN 2 AND 11']
        left = sqlite3.connect(path).execute('SELECT value FROM records ORDER BY "offset"').fetchall()
        assert [bytes(v) for (v,) in left] == [b"b0", b"later"]
        assert queue.depth() == 2
    finally:
        queue.close()
