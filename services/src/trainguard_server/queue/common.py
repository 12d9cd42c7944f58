"""Argument checks, offset bookkeeping and lanes every queue implementation shares (SQLite, Kafka, memory),
so all of them refuse the same bad calls with the same messages and hand out records in the same order."""

from __future__ import annotations

import zlib
from collections import deque
from typing import Deque, Dict, Generic, List, Optional, Sequence, Tuple, TypeVar

from .base import QueueRecord, RebalanceListener

PARTITION = 0

DEFAULT_LANES = 65_536
"""Lanes of the embedded queues' one partition (``TRAINGUARD_QUEUE_LANES``): a run shares its lane -- and
waits behind the backlog in it -- with the runs whose ids hash to the same one, so many lanes make that
rare: 1 in 65,536 for two runs. With 1,024 one probe of 120 in a bench run waited 20.6 s, the noisy run's
backlog then -- a shared lane, most likely (bench/results/latency_issue15_stop39.txt; 120 probes meet one
in ~11 % of runs at 1,024 lanes); with 64, ~2 of 120 quiet runs would. A lane costs nothing while it is
empty: nothing is stored per lane, the consumer walks only the lanes that hold records, and the highest
committed offset is remembered per lane used (an int each)."""

T = TypeVar("T")


def lane_of(key: str, lanes: int) -> int:
    """The lane of ``key`` among ``lanes``: CRC-32 of its UTF-8 bytes modulo ``lanes`` (stable across
    processes and versions, unlike ``hash()``; a run's records always share one lane)."""
    return zlib.crc32(key.encode("utf-8", "surrogatepass")) % lanes


def check_lanes(lanes: int) -> int:
    """``lanes`` when it is a positive integer; ValueError otherwise."""
    if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
        raise ValueError(f"lanes must be a positive integer, not {lanes!r}")
    return lanes


def check_partitions(partitions: int) -> int:
    """``partitions`` when it is a positive integer; ValueError otherwise."""
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise ValueError(f"partitions must be a positive integer, not {partitions!r}")
    return partitions


def check_consume_args(max_records: int, timeout: float) -> None:
    """ValueError unless ``max_records`` ≥ 1 and ``timeout`` ≥ 0 (shared by the queue implementations)."""
    if isinstance(max_records, bool) or not isinstance(max_records, int) or max_records < 1:
        raise ValueError(f"max_records must be a positive integer, not {max_records!r}")
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0, not {timeout!r}")


def commit_offset(records: Sequence[QueueRecord]) -> int:
    """The highest offset among ``records`` (all of partition 0); -1 for none. ValueError otherwise."""
    top = -1
    for record in records:
        if record.partition != PARTITION:
            raise ValueError(f"unknown partition {record.partition}: this queue has only partition 0")
        top = max(top, record.offset)
    return top


def commit_tops(records: Sequence[QueueRecord], lanes: int, partitions: int = 1) -> Dict[int, int]:
    """The highest offset among ``records`` per lane (lanes below ``lanes``, each record of its lane's
    partition, ``lane % partitions``): what a commit of them covers. ValueError for another partition or
    lane."""
    tops: Dict[int, int] = {}
    for record in records:
        if not 0 <= record.partition < partitions:
            held = "only partition 0" if partitions == 1 else f"partitions 0-{partitions - 1}"
            raise ValueError(f"unknown partition {record.partition}: this queue has {held}")
        lane = record.lane
        if not 0 <= lane < lanes:
            raise ValueError(f"unknown lane {lane}: this queue has lanes 0-{lanes - 1}")
        if record.partition != lane % partitions:
            raise ValueError(f"partition {record.partition} does not hold lane {lane} (lane {lane} is in "
                             f"partition {lane % partitions} of {partitions})")
        if record.offset > tops.get(lane, -1):
            tops[lane] = record.offset
    return tops


def check_publish_args(key: str, values: Sequence[bytes]) -> None:
    if not isinstance(key, str):
        raise TypeError("key must be a str")
    for value in values:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError("values must be bytes")


class StaticPartitions:
    """The partitions of an embedded queue (SQLite, memory): a lane's records are in partition ``lane %
    partitions``, and the queue's one consumer owns every partition, always. A rebalance listener set on
    a queue of several partitions is told ``partitions_assigned(range(partitions))`` once, from the
    first ``consume`` after it was set (the consuming thread, as Kafka's are), and never told of a
    revocation; with one partition it is never called (the queue is not ``partitioned``)."""

    def __init__(self, partitions: int) -> None:
        self.count = check_partitions(partitions)
        self._listener: Optional[RebalanceListener] = None
        self._told = True

    def listen(self, listener: Optional[RebalanceListener]) -> None:
        """``listener`` is told of the assignment at the next :meth:`tell` (None: nobody is)."""
        self._listener = listener
        self._told = listener is None or self.count == 1

    def tell(self) -> None:
        """Tell the listener of its partitions if it was not told yet (from ``consume``, before it takes
        records). One that raises is told again at the next call."""
        if self._told:
            return
        listener = self._listener
        if listener is not None:
            listener.partitions_assigned(range(self.count))
        self._told = True


class Lanes(Generic[T]):
    """The records not yet handed out, per lane, and whose turn it is (not thread-safe: callers lock).

    ``add`` a record's offset (and an item: the record itself, or nothing where the caller reads it
    later) in offset order per lane; ``take(n)`` hands out up to ``n``: one from the first lane in turn,
    which then goes to the back of the turn if it still holds records -- round-robin over the lanes that
    hold records, a lane that gets its first record joining at the back. ``committed(lane, top)`` forgets
    the lane's records up to ``top`` (handed out or not) and ignores any added later at or below it."""

    def __init__(self) -> None:
        self._waiting: Dict[int, Deque[Tuple[int, T]]] = {}
        self._turns: Deque[int] = deque()
        self._done: Dict[int, int] = {}   # lane -> highest offset committed
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, lane: int, offset: int, item: T) -> None:
        if offset <= self._done.get(lane, -1):
            return
        waiting = self._waiting.get(lane)
        if waiting is None:
            waiting = self._waiting[lane] = deque()
            self._turns.append(lane)
        waiting.append((offset, item))
        self._count += 1

    def extend(self, lane: int, entries: Sequence[Tuple[int, T]]) -> None:
        """``add`` of each ``(offset, item)`` of ``entries`` (ascending offsets, one lane), in one call: what
        a queue reads in bulk (a run's records are consecutive in its lane)."""
        if not entries:
            return
        done = self._done.get(lane, -1)
        if entries[0][0] <= done:
            entries = [e for e in entries if e[0] > done]
            if not entries:
                return
        waiting = self._waiting.get(lane)
        if waiting is None:
            waiting = self._waiting[lane] = deque()
            self._turns.append(lane)
        waiting.extend(entries)
        self._count += len(entries)

    def take(self, n: int) -> List[Tuple[int, int, T]]:
        """Up to ``n`` ``(lane, offset, item)``, round-robin over the lanes (see the class)."""
        turns, waiting = self._turns, self._waiting
        if len(turns) == 1:  # one lane holds records: its first n (what the turns below would hand out)
            lane = turns[0]
            mine = waiting[lane]
            pop = mine.popleft
            one = [(lane, *pop()) for _ in range(min(n, len(mine)))]
            if not mine:
                turns.clear()
                del waiting[lane]
            self._count -= len(one)
            return one
        out: List[Tuple[int, int, T]] = []
        while len(out) < n and turns:
            lane = turns.popleft()
            mine = waiting[lane]
            offset, item = mine.popleft()
            out.append((lane, offset, item))
            if mine:
                turns.append(lane)
            else:
                del waiting[lane]
        self._count -= len(out)
        return out

    def committed(self, lane: int, top: int) -> List[Tuple[int, T]]:
        """Forget ``lane``'s records up to ``top``; returns those not handed out yet ``(offset, item)``."""
        if top > self._done.get(lane, -1):
            self._done[lane] = top
        mine = self._waiting.get(lane)
        gone: List[Tuple[int, T]] = []
        if mine is None:
            return gone
        while mine and mine[0][0] <= top:  # committed before they were handed out (not the usual way)
            gone.append(mine.popleft())
        self._count -= len(gone)
        if not mine:
            del self._waiting[lane]
            self._turns.remove(lane)
        return gone

    def clear(self) -> None:
        self._waiting.clear()
        self._turns.clear()
        self._count = 0
