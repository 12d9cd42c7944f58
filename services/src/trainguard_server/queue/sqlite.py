"""SqliteQueue: the embedded server's durable queue — one table in its own file (``queue.db``), one
partition (0) or ``partitions`` of them.

- ``publish`` inserts all values in one transaction and returns their offsets after COMMIT; with the
  default ``synchronous=FULL`` that commit is fsynced to the WAL, so an acknowledged batch survives a
  process kill and a power loss (``NORMAL``: a kill only). Offsets come from AUTOINCREMENT: strictly
  increasing and never reused, even after every row has been committed and deleted.
- ``consume`` hands out uncommitted records fairly between runs: each key (run id) is in one of ``lanes``
  lanes (:func:`.common.lane_of`, a stable hash), each lane's records are handed out in offset order, and
  the lanes that hold records take turns, one record each (:class:`.common.Lanes`) -- so a quiet run's
  record waits behind at most one record of each other busy lane, never behind a noisy run's whole backlog.
  Which records were handed out is kept in memory only: after a restart everything uncommitted is handed
  out again (at-least-once). The lanes are computed from the keys when a record is first seen (the
  records table is the one before lanes, so a queue file of any version opens as it is; ``lanes`` may
  change between runs of the server while the file has one partition).
- ``commit`` deletes, per lane, every record up to the highest committed offset of that lane (the other
  lanes' records, handed out or not, stay); a commit of every record the file holds empties the table
  whole (:func:`_delete`).
- Partitions (``TRAINGUARD_QUEUE_PARTITIONS``): with ``partitions`` P > 1 a record is in partition ``lane %
  P`` (``QueueRecord.partition``; a lane, so a run, is in one partition), the queue is ``partitioned`` and
  its one consumer owns every partition, always (a static assignment): a rebalance listener is told
  ``partitions_assigned(range(P))`` once, from the first ``consume`` after it is set, and never of a
  revocation -- so the processor keeps one detection state per partition, as over Kafka, and may run
  partitions in parallel. Consuming, fairness (one round-robin over every lane, whatever its partition)
  and commits are those of one partition. P is stored in the file (table ``meta``) the first time it
  opens with P > 1, like a Kafka topic's partition count, and the lane count with it (a run's partition is
  its lane modulo P: another lane count would move runs to a partition whose state does not know them):
  every later open uses the stored P and lanes, whatever it is asked for (a warning says so when they
  differ). Two processes opening a new file at once agree: the rows are written and read back in one
  write transaction, the first writer's stand. ``partitions`` 1 (the default): partition 0, not
  ``partitioned``, no listener calls, no count stored, ``lanes`` free to change between starts.
  ``partitions`` None (a publish-only handle, e.g. a gateway-only process): the file's count, deciding
  nothing and warning of nothing -- the processor's handle decides.
- ``identity``: a random id the file gets when first opened by this version (``meta``), kept for its life: a
  processor saves it with the offsets its snapshot covers, so a queue file moved aside or restored from a
  backup -- offsets from 1 again -- is not mistaken for the one the cover was written for.
- ``depth`` is kept in memory (counted at open, then adjusted by publish/commit): exact in a process that
  both publishes and consumes (``trainguard serve``); a handle that only publishes or only consumes (a
  gateway and a processor in two processes on one data dir) counts the file again at most every
  :data:`RECOUNT_EVERY_S`, and before refusing a publish at the limit.
- QueueFull when ``depth() >= max_depth`` (the batch that crosses the line is accepted whole).
- A consumer waiting in ``consume(timeout)`` is woken by a publish in this process through a Condition;
  it also re-reads the table every ``poll_interval`` s, so another process's publishes are seen too.

Publishes share commits (group commit): a publish that finds none in progress commits every publish
waiting at that moment in one transaction -- one fsync for all of them -- and each returns (is
acknowledged) only after that COMMIT, so durability is the same as one transaction each; should the group
fail, each of its publishes is retried alone, so one publish's failure is never another's. Writes go
through one writer connection; the consumer reads on its own connection, so WAL lets it read while a
publish commits. The file's page size is 16 KiB (set when it is created): measured faster
than 4 KiB and 64 KiB for ~100 KB records. Deleted records are not overwritten with zeros
(:data:`SECURE_DELETE`).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
import uuid
from collections import deque
from functools import partial
from itertools import groupby
from operator import itemgetter
from pathlib import Path
from typing import Deque, Dict, List, Optional, Sequence, Tuple, Union

from trainguard_server.storage.sqlite import DEFAULT_SYNCHRONOUS, connect, opening

from .base import Queue, QueueFull, QueueRecord, RebalanceListener
from .common import (
    DEFAULT_LANES,
    Lanes,
    StaticPartitions,
    check_consume_args,
    check_lanes,
    check_partitions,
    check_publish_args,
    commit_tops,
    lane_of,
)

log = logging.getLogger("trainguard.queue.sqlite")

QUEUE_DB = "queue.db"
PAGE_SIZE = 16384
SECURE_DELETE = "OFF"
"""The queue connections' ``PRAGMA secure_delete``: OFF (SQLite's own default) -- a committed record's
bytes are left where they were (free space inside a page, or a free-list page, reused by later
publishes), not overwritten with zeros. Some SQLite builds default to ON (Debian's, which this
interpreter links: SQLITE_SECURE_DELETE), which wrote every page of every committed record again, as
zeros, into the WAL and then the file: for ~120 KB records (bench/ingest.py's 500 events) a commit cost
0.15 ms CPU and 0.46 ms wall a record instead of 0.06 / 0.06, and a checkpoint's commit of a serve
backlog's ~1,000 records ~0.5 s; the processor's own part of an env500 drain (pipeline stubbed) 245-248 ms
CPU instead of 222-224 (/work/notes/s49/hP2_report.md). FAST would still zero small records inside
their pages. Zeroing would hide nothing: the records' content is kept in the stores' files anyway
(metric points, raw events). The rows are the same either way (hP2, stop 49)."""
_IN_LIMIT = 500  # offsets per "IN (...)" read (SQLite allows 999 variables in old builds)
_KEY = itemgetter(1)  # a row's key in (offset, key)
_LANE = itemgetter(0)  # a taken record's lane in (lane, offset, _)
_RANGE_SQL = ('SELECT ?1, "offset", key, value, published_ns, ?4 FROM records '
              'WHERE "offset" BETWEEN ?2 AND ?3 ORDER BY "offset"')
"""A range of one lane's records, each row a :class:`QueueRecord`'s fields in order (partition and lane
bound: ``(partition, first, last, lane)``; INTEGER, TEXT, BLOB, INTEGER columns read as int, str, bytes,
int)."""
_DELETE_SQL = 'DELETE FROM records WHERE "offset" BETWEEN ? AND ?'
_CLEAR_SQL = "DELETE FROM records"  # every row: SQLite's truncate optimization (pages freed whole)
_BOUNDS_SQL = 'SELECT (SELECT MIN("offset") FROM records), (SELECT MAX("offset") FROM records)'
_AS_RECORD = partial(tuple.__new__, QueueRecord)
"""A row of :data:`_RANGE_SQL` as a QueueRecord (a NamedTuple is a tuple: built in C, no ``__new__`` call in
Python)."""

_SCHEMA = (
    'CREATE TABLE IF NOT EXISTS records ("offset" INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL, '
    "value BLOB NOT NULL, published_ns INTEGER NOT NULL)"
)
_META = "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)"
_PARTITIONS = "partitions"  # meta's row of the partition count (absent: one partition)
_LANES = "lanes"            # meta's row of the lane count, stored with the partitions (absent: not fixed)
_QUEUE_ID = "queue_id"      # meta's row of the file's random id (Queue.identity)
RECOUNT_EVERY_S = 1.0
"""A handle that only publishes or only consumes (a gateway and a processor in two processes) does not see
the other's publishes or commits: its :meth:`SqliteQueue.depth`, and any handle's QueueFull check at the
limit, count the file's records again at most this often."""


class _Waiting:
    """One publish waiting for its group's commit."""

    __slots__ = ("done", "error", "key", "offsets", "rows")

    def __init__(self, key: str, rows: List[bytes]) -> None:
        self.key = key
        self.rows = rows
        self.offsets: List[int] = []
        self.error: Optional[BaseException] = None
        self.done = False


class SqliteQueue(Queue):
    """Durable embedded queue in the SQLite file ``path``."""

    def __init__(self, path: Union[str, Path], *, max_depth: int = 50_000, retry_after: float = 1.0,
                 synchronous: str = DEFAULT_SYNCHRONOUS, poll_interval: float = 0.25,
                 lanes: int = DEFAULT_LANES, partitions: Optional[int] = 1) -> None:
        if max_depth < 1:
            raise ValueError("max_depth must be >= 1")
        self.lanes = check_lanes(lanes)
        if partitions is not None:  # None: a publish-only handle -- the file's count, whatever it is
            check_partitions(partitions)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._max_depth = max_depth
        self._retry_after = retry_after
        self._poll_interval = poll_interval
        self._write_lock = threading.Lock()
        self._group = threading.Condition()  # guards _arrived / _leading (group commit)
        self._arrived: List[_Waiting] = []   # publishes waiting for the next commit
        self._leading = False                # a publish is committing a group now
        self._consume_lock = threading.Lock()   # one consume() at a time
        self._index_lock = threading.Lock()     # guards the lanes below (commit must not wait for a consume)
        self._waiting: Lanes[None] = Lanes()    # not handed out yet: offsets per lane, whose turn it is
        self._held: Dict[int, Deque[int]] = {}  # handed out, not committed: offsets per lane, ascending
        self._known = 0                         # highest offset read into the lanes; offsets start at 1
        self._cond = threading.Condition()
        self._generation = 0           # bumped by every publish (under _cond)
        self._closed = False
        self._consumed = False   # consume() was called: this handle commits
        self._published = False  # publish() was called: with _consumed, its own count is exact
        new_file = not self.path.exists()
        with opening(self.path):  # a damaged or read-only file: StoreOpenError naming it
            self._writer = self._open(synchronous, page_size=PAGE_SIZE if new_file else None)
            self._writer.execute(_SCHEMA)
            self._reader = self._open(synchronous)
            self._depth = self._count()
            meta = self._meta(partitions or 1)
        self.identity = meta[_QUEUE_ID]
        self._partitions = StaticPartitions(check_partitions(int(meta.get(_PARTITIONS, "1"))))
        self.partitions = self._partitions.count
        self.partitioned = self.partitions > 1
        if self.partitioned:  # a run's partition is its lane modulo the count: both stay as first stored
            self.lanes = check_lanes(int(meta.get(_LANES, str(self.lanes))))
        if partitions is not None and self.partitions != partitions:
            log.warning("%s holds %d partitions, fixed when it was first opened with more than one (the "
                        "processor keeps its detection state per partition): the %d asked for now are "
                        "ignored", self.path, self.partitions, partitions)
        if self.partitioned and self.lanes != lanes:
            log.warning("%s holds %d lanes, fixed with its %d partitions (a run's partition is its lane "
                        "modulo them): the %d asked for now (queue_lanes) are ignored", self.path, self.lanes,
                        self.partitions, lanes)
        self._recounted = time.monotonic()

    def _count(self) -> int:
        """Records in the file now (published, not committed, by any process)."""
        return int(self._writer.execute("SELECT COUNT(*) FROM records").fetchone()[0])

    def _meta(self, partitions: int) -> Dict[str, str]:
        """The file's meta rows, made complete in one write transaction (so two processes opening a new file
        at once agree -- the first to write decides): the file's random id (:attr:`identity`, made once), and
        when ``partitions`` > 1 and none is stored yet, the partition count and the lane count (both fixed
        from then on: a file of one partition stores neither)."""
        conn = self._writer
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(_META)
            rows = [(_QUEUE_ID, uuid.uuid4().hex)]
            if partitions > 1:
                rows += [(_PARTITIONS, str(partitions)), (_LANES, str(self.lanes))]
                if conn.execute("SELECT 1 FROM meta WHERE name = ?", (_PARTITIONS,)).fetchone():
                    rows = rows[:1]  # the count stored first stays, and the lanes stored with it
            conn.executemany("INSERT OR IGNORE INTO meta (name, value) VALUES (?, ?)", rows)
            meta = {str(name): str(value) for name, value in conn.execute("SELECT name, value FROM meta")}
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        return meta

    def _open(self, synchronous: str, page_size: Optional[int] = None) -> sqlite3.Connection:
        if page_size:
            # page_size must be set before the file gets its first page, hence before WAL is switched on
            conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
            conn.execute(f"PRAGMA page_size = {page_size}")
            conn.execute("VACUUM")
            conn.close()
        conn = connect(self.path, synchronous)
        conn.execute(f"PRAGMA secure_delete = {SECURE_DELETE}")
        return conn

    def publish(self, key: str, values: Sequence[bytes]) -> List[int]:
        check_publish_args(key, values)
        if not values:
            return []
        self._published = True
        mine = _Waiting(key, [bytes(v) for v in values])
        group = self._group
        with group:
            self._arrived.append(mine)
            while not mine.done:
                if self._leading:  # another publish is committing: ours goes in the next commit
                    group.wait()
                    continue
                self._leading = True
                batch, self._arrived = self._arrived, []
                group.release()
                try:
                    self._commit_group(batch)
                finally:
                    group.acquire()
                    self._leading = False
                    group.notify_all()
        if mine.error is not None:
            raise mine.error
        with self._cond:
            self._generation += 1
            self._cond.notify_all()
        return mine.offsets

    def _commit_group(self, batch: List[_Waiting]) -> None:
        """Write every waiting publish in one transaction (one fsync); if that fails, each alone, so one
        publish's failure is its own. Marks every waiter done, with its offsets or its error."""
        try:
            with self._write_lock:
                try:
                    self._check_open()
                except Exception as exc:
                    for w in batch:
                        w.error = exc
                    return
                accepted = self._admit(batch)
                try:
                    self._insert(accepted)
                except Exception:
                    for w in accepted:  # one by one: the failure stays with the publish that caused it
                        w.offsets, w.error = [], None
                        try:
                            self._insert([w])
                        except Exception as exc:
                            w.error = exc
        finally:
            for w in batch:
                if w.error is None and not w.offsets:  # the commit was interrupted before it decided
                    w.error = RuntimeError("the publish was interrupted before its commit")
                w.done = True

    def _admit(self, batch: List[_Waiting]) -> List[_Waiting]:
        """The waiters the depth limit lets in, in arrival order (the one that crosses the line whole)."""
        accepted: List[_Waiting] = []
        if self._depth >= self._max_depth:  # at the limit: another process may have committed
            self._recount_due()
        depth = self._depth
        for w in batch:
            if depth >= self._max_depth:
                w.error = QueueFull(f"queue holds {depth} unprocessed records (max {self._max_depth})",
                                    retry_after=self._retry_after)
                continue
            accepted.append(w)
            depth += len(w.rows)
        return accepted

    def _insert(self, waiters: List[_Waiting]) -> None:
        """One transaction for ``waiters`` (under the write lock); their offsets set after COMMIT."""
        if not waiters:
            return
        now = time.time_ns()
        conn = self._writer
        conn.execute("BEGIN IMMEDIATE")
        lasts: List[int] = []
        try:
            for w in waiters:
                conn.executemany("INSERT INTO records (key, value, published_ns) VALUES (?, ?, ?)",
                                 [(w.key, v, now) for v in w.rows])
                lasts.append(int(conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'records'")
                                 .fetchone()[0]))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        for w, last in zip(waiters, lasts):
            w.offsets = list(range(last - len(w.rows) + 1, last + 1))
            self._depth += len(w.rows)

    def set_rebalance_listener(self, listener: Optional[RebalanceListener]) -> None:
        self._partitions.listen(listener)

    def consume(self, max_records: int, timeout: float) -> List[QueueRecord]:
        check_consume_args(max_records, timeout)
        deadline = time.monotonic() + timeout
        self._consumed = True
        with self._consume_lock:
            self._partitions.tell()
            while True:
                with self._cond:
                    generation = self._generation
                    if self._closed:
                        return []
                self._read_new(self._reader)
                with self._index_lock:
                    taken = self._waiting.take(max_records)
                    for lane, same in groupby(taken, _LANE):
                        held = self._held.get(lane)
                        if held is None:
                            held = self._held[lane] = deque()
                        held.extend(offset for _, offset, _ in same)
                if taken:
                    records = self._read_records(taken)
                    if records:
                        return records
                    continue  # all of them committed meanwhile (by another handle): look again
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                with self._cond:
                    if self._closed:
                        return []
                    if self._generation == generation:
                        self._cond.wait(min(remaining, self._poll_interval))

    def _read_new(self, conn: sqlite3.Connection) -> None:
        """Put the records published since the last look (by any process) in their lanes: their offsets
        and keys only (the key is the row's first column: no value is read). Offsets become visible in
        increasing order (one writer at a time), so nothing below the highest one seen can appear later."""
        rows = conn.execute('SELECT "offset", key FROM records WHERE "offset" > ? ORDER BY "offset"',
                            (self._known,)).fetchall()
        if not rows:
            return
        lanes = self.lanes
        with self._index_lock:
            known = self._known  # another thread may have read some of them meanwhile (consume vs commit)
            extend = self._waiting.extend
            for key, same in groupby(rows, _KEY):  # consecutive records of one key: one lane, one call
                extend(lane_of(key, lanes), [(offset, None) for offset, _ in same if offset > known])
            self._known = max(known, int(rows[-1][0]))

    def _read_records(self, taken: List[Tuple[int, int, None]]) -> List[QueueRecord]:
        """The records of ``taken`` ``(lane, offset, _)``, in that order (one still there is skipped).
        Consecutive offsets of one lane (a run's backlog: the usual take) are read with one range query
        whose rows are the records themselves (:data:`_RANGE_SQL`), no per-record Python code."""
        lane, first = taken[0][0], taken[0][1]
        if taken[-1][1] - first == len(taken) - 1 and len(set(map(_LANE, taken))) == 1:
            # one lane's offsets ascend: first..last with as many offsets as records is every one between
            return list(map(_AS_RECORD, self._reader.execute(
                _RANGE_SQL, (lane % self.partitions, first, first + len(taken) - 1, lane))))
        found: Dict[int, Tuple[int, str, bytes, int]] = {}
        offsets = [offset for _, offset, _ in taken]
        for at in range(0, len(offsets), _IN_LIMIT):
            part = offsets[at:at + _IN_LIMIT]
            marks = ",".join("?" * len(part))
            query = f'SELECT "offset", key, value, published_ns FROM records WHERE "offset" IN ({marks})'
            found.update((row[0], row) for row in self._reader.execute(query, part))
        out: List[QueueRecord] = []
        partitions = self.partitions
        get, add = found.get, out.append
        for lane, offset, _ in taken:
            row = get(offset)
            if row is not None:  # (columns INTEGER, TEXT, BLOB, INTEGER: int, str, bytes, int as read)
                add(_AS_RECORD((lane % partitions, offset, row[1], row[2], row[3], lane)))
        return out

    def commit(self, records: Sequence[QueueRecord]) -> None:
        tops = commit_tops(records, self.lanes, self.partitions)
        if not tops:
            return
        with self._write_lock:
            self._check_open()
            self._read_new(self._writer)  # records this handle has not looked at yet (just reopened)
            with self._index_lock:  # the lanes' records up to their tops: handed out or not (the latter rare)
                gone: List[int] = []
                for lane, top in tops.items():
                    held = self._held.get(lane)
                    if held and held[-1] <= top:  # all the lane handed out (the usual commit): at once
                        gone.extend(held)
                        held.clear()
                    while held and held[0] <= top:
                        gone.append(held.popleft())
                    if held is not None and not held:
                        del self._held[lane]
                    gone.extend(offset for offset, _ in self._waiting.committed(lane, top))
            if not gone:
                return
            conn = self._writer
            conn.execute("BEGIN IMMEDIATE")
            try:
                deleted = _delete(conn, _ranges(sorted(gone)))
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            self._depth -= max(deleted, 0)

    def depth(self) -> int:
        """Records published and not committed: kept in memory (an int read, never waiting for a publish's
        fsync) by a handle that both publishes and consumes (``trainguard serve``); one that only publishes
        or only consumes -- a gateway and a processor in two processes -- counts the file again at most
        every :data:`RECOUNT_EVERY_S`."""
        if not (self._consumed and self._published) and time.monotonic() - self._recounted >= RECOUNT_EVERY_S:
            with self._write_lock:  # so no publish of this handle is half counted
                if not self._closed:
                    self._recount_due()
        return max(0, self._depth)

    def _recount_due(self) -> None:
        """The depth from the file when the last count is :data:`RECOUNT_EVERY_S` old (under the write
        lock)."""
        if time.monotonic() - self._recounted >= RECOUNT_EVERY_S:
            self._depth = self._count()
            self._recounted = time.monotonic()

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


def _delete(conn: sqlite3.Connection, ranges: List[Tuple[int, int]]) -> int:
    """Delete the records of ``ranges`` (``(first, last)`` offsets) inside the caller's write transaction;
    returns how many rows went. When one range holds every record the file has (the lowest and highest
    offsets, two rowid look-ups, fall in it: a drained queue's checkpoint) the table is emptied with a
    plain ``DELETE FROM records`` -- the same rows, but SQLite's truncate optimization frees the table's
    pages whole instead of deleting row by row (6,432 SDK-sized records: ~0.7 ms CPU instead of ~3.7).
    The write transaction keeps any other writer out between the look-up and the delete; the
    AUTOINCREMENT sequence is kept either way (offsets are never reused)."""
    if len(ranges) == 1:
        first, last = ranges[0]
        low, high = conn.execute(_BOUNDS_SQL).fetchone()
        if low is not None and first <= low and high <= last:
            return int(conn.execute(_CLEAR_SQL).rowcount)
    return int(conn.executemany(_DELETE_SQL, ranges).rowcount)


def _ranges(offsets: List[int]) -> List[Tuple[int, int]]:
    """Runs of consecutive integers in the ascending, distinct ``offsets`` (a commit's: a lane's handed-out
    and waiting records are disjoint), as ``(first, last)``: one range delete each (a noisy run's committed
    records are mostly consecutive)."""
    if offsets and offsets[-1] - offsets[0] == len(offsets) - 1:  # distinct and ascending: consecutive
        return [(offsets[0], offsets[-1])]
    out: List[Tuple[int, int]] = []
    for offset in offsets:
        if out and offset == out[-1][1] + 1:
            out[-1] = (out[-1][0], offset)
        else:
            out.append((offset, offset))
    return out
