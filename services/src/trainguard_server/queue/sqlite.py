"""SqliteQueue: the embedded server's durable queue — one table in its own file (``queue.db``), one
partition (0).

- ``publish`` inserts all values in one transaction and returns their offsets after COMMIT; with the
  default ``synchronous=FULL`` that commit is fsynced to the WAL, so an acknowledged batch survives a
  process kill and a power loss (``NORMAL``: a kill only). Offsets come from AUTOINCREMENT: strictly
  increasing and never reused, even after every row has been committed and deleted.
- ``consume`` hands out uncommitted records in offset order and remembers, in memory only, the highest
  offset handed out: after a restart everything uncommitted is handed out again (at-least-once).
- ``commit`` deletes every row up to the highest committed offset.
- ``depth`` is kept in memory (counted at open, then adjusted by publish/commit): exact while this
  process is the only writer, which is how the embedded server uses it.
- QueueFull when ``depth() >= max_depth`` (the batch that crosses the line is accepted whole).
- A consumer waiting in ``consume(timeout)`` is woken by a publish in this process through a Condition;
  it also re-reads the table every ``poll_interval`` s, so another process's publishes are seen too.

Publishes are serialised on one writer connection; the consumer reads on its own connection, so WAL lets
it read while a publish commits. The file's page size is 16 KiB (set when it is created): measured faster
than 4 KiB and 64 KiB for ~100 KB records.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import List, Optional, Sequence, Union

from trainguard_server.storage.sqlite import DEFAULT_SYNCHRONOUS, connect

from .base import Queue, QueueFull, QueueRecord
from .common import PARTITION, check_consume_args, check_publish_args, commit_offset

QUEUE_DB = "queue.db"
PAGE_SIZE = 16384

_SCHEMA = (
    'CREATE TABLE IF NOT EXISTS records ("offset" INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL, '
    "value BLOB NOT NULL, published_ns INTEGER NOT NULL)"
)


class SqliteQueue(Queue):
    """Durable embedded queue in the SQLite file ``path``."""

    def __init__(self, path: Union[str, Path], *, max_depth: int = 50_000, retry_after: float = 1.0,
                 synchronous: str = DEFAULT_SYNCHRONOUS, poll_interval: float = 0.25) -> None:
        if max_depth < 1:
            raise ValueError("max_depth must be >= 1")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._max_depth = max_depth
        self._retry_after = retry_after
        self._poll_interval = poll_interval
        self._write_lock = threading.Lock()
        self._consume_lock = threading.Lock()   # one consume() at a time
        self._handed_lock = threading.Lock()    # guards _handed (commit must not wait for a consume)
        self._cond = threading.Condition()
        self._generation = 0           # bumped by every publish (under _cond)
        self._closed = False
        new_file = not self.path.exists()
        self._writer = self._open(synchronous, page_size=PAGE_SIZE if new_file else None)
        self._writer.execute(_SCHEMA)
        self._reader = self._open(synchronous)
        self._depth = int(self._writer.execute("SELECT COUNT(*) FROM records").fetchone()[0])
        self._handed = 0               # highest offset handed out; offsets start at 1

    def _open(self, synchronous: str, page_size: Optional[int] = None) -> sqlite3.Connection:
        if page_size:
            # page_size must be set before the file gets its first page, hence before WAL is switched on
            conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
            conn.execute(f"PRAGMA page_size = {page_size}")
            conn.execute("VACUUM")
            conn.close()
        return connect(self.path, synchronous)

    def publish(self, key: str, values: Sequence[bytes]) -> List[int]:
        check_publish_args(key, values)
        if not values:
            return []
        now = time.time_ns()
        with self._write_lock:
            self._check_open()
            if self._depth >= self._max_depth:
                raise QueueFull(f"queue holds {self._depth} unprocessed records (max {self._max_depth})",
                                retry_after=self._retry_after)
            conn = self._writer
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.executemany("INSERT INTO records (key, value, published_ns) VALUES (?, ?, ?)",
                                 [(key, bytes(v), now) for v in values])
                last = int(conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'records'")
                           .fetchone()[0])
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            self._depth += len(values)
        with self._cond:
            self._generation += 1
            self._cond.notify_all()
        return list(range(last - len(values) + 1, last + 1))

    def consume(self, max_records: int, timeout: float) -> List[QueueRecord]:
        check_consume_args(max_records, timeout)
        deadline = time.monotonic() + timeout
        with self._consume_lock:
            while True:
                with self._cond:
                    generation = self._generation
                    if self._closed:
                        return []
                with self._handed_lock:
                    handed = self._handed
                rows = self._reader.execute(
                    'SELECT "offset", key, value, published_ns FROM records WHERE "offset" > ? '
                    'ORDER BY "offset" LIMIT ?', (handed, max_records)).fetchall()
                if rows:
                    with self._handed_lock:
                        self._handed = max(self._handed, int(rows[-1][0]))
                    return [QueueRecord(partition=PARTITION, offset=int(o), key=k, value=bytes(v),
                                        published_ns=int(ns)) for o, k, v, ns in rows]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                with self._cond:
                    if self._closed:
                        return []
                    if self._generation == generation:
                        self._cond.wait(min(remaining, self._poll_interval))

    def commit(self, records: Sequence[QueueRecord]) -> None:
        top = commit_offset(records)
        if top < 0:
            return
        with self._write_lock:
            self._check_open()
            conn = self._writer
            conn.execute("BEGIN IMMEDIATE")
            try:
                deleted = conn.execute('DELETE FROM records WHERE "offset" <= ?', (top,)).rowcount
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            self._depth -= max(deleted, 0)
        with self._handed_lock:
            self._handed = max(self._handed, top)

    def depth(self) -> int:
        return self._depth  # an int read: never waits for a publish's fsync

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        with self._write_lock, self._consume_lock:
            self._writer.close()
            self._reader.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("queue is closed")
