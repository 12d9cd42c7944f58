"""MemoryQueue: the queue contract in memory — bounded, ordered per key, fair between keys, not durable; one
partition (0), or ``partitions`` of them as the SQLite queue has (its docstring: a lane's records are in
partition ``lane % partitions``, all of them this consumer's).

For tests and for a server that may lose unprocessed batches on a crash. ``publish`` raises QueueFull when
``max_depth`` records are uncommitted (the call that crosses the line is accepted whole, so a batch is never
split); a consumer blocked in ``consume`` wakes as soon as something is published or the queue is closed.
Like the SQLite queue, records are handed out round-robin over the keys' lanes (:class:`.common.Lanes`),
each lane's in offset order; ``commit`` covers a lane's records up to the committed offset.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from typing import Deque, Dict, List, Optional, Sequence

from .base import Queue, QueueFull, QueueRecord, RebalanceListener
from .common import (
    DEFAULT_LANES,
    Lanes,
    StaticPartitions,
    check_consume_args,
    check_lanes,
    check_publish_args,
    commit_tops,
    lane_of,
)


class MemoryQueue(Queue):
    """Bounded in-memory queue; offsets start at 0 and are never reused."""

    def __init__(self, max_depth: int = 50_000, *, retry_after: float = 1.0,
                 lanes: int = DEFAULT_LANES, partitions: int = 1) -> None:
        if max_depth < 1:
            raise ValueError("max_depth must be >= 1")
        self.lanes = check_lanes(lanes)
        self._partitions = StaticPartitions(partitions)
        self.partitions = self._partitions.count
        self.partitioned = self.partitions > 1
        self.identity = uuid.uuid4().hex  # offsets start at 1 in every instance
        self._max_depth = max_depth
        self._retry_after = retry_after
        self._cond = threading.Condition()
        self._waiting: Lanes[QueueRecord] = Lanes()   # not handed out yet
        self._held: Dict[int, Deque[int]] = {}        # handed out, not committed: offsets per lane
        self._depth = 0                               # uncommitted records
        self._next_offset = 0
        self._closed = False

    def publish(self, key: str, values: Sequence[bytes]) -> List[int]:
        check_publish_args(key, values)
        with self._cond:
            if self._closed:
                raise RuntimeError("queue is closed")
            if self._depth >= self._max_depth:
                raise QueueFull(f"queue holds {self._depth} unprocessed records "
                                f"(max {self._max_depth})", retry_after=self._retry_after)
            now = time.time_ns()
            lane = lane_of(key, self.lanes)
            partition = lane % self.partitions
            offsets = []
            for value in values:
                offset = self._next_offset
                self._waiting.add(lane, offset, QueueRecord(partition=partition, offset=offset, key=key,
                                                            value=bytes(value), published_ns=now, lane=lane))
                offsets.append(offset)
                self._next_offset += 1
            self._depth += len(offsets)
            if offsets:
                self._cond.notify_all()
            return offsets

    def set_rebalance_listener(self, listener: Optional[RebalanceListener]) -> None:
        self._partitions.listen(listener)

    def consume(self, max_records: int, timeout: float) -> List[QueueRecord]:
        check_consume_args(max_records, timeout)
        deadline = time.monotonic() + timeout
        self._partitions.tell()
        with self._cond:
            while not self._closed and not self._waiting:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._cond.wait(remaining)
            out = []
            for lane, offset, record in self._waiting.take(max_records):
                held = self._held.get(lane)
                if held is None:
                    held = self._held[lane] = deque()
                held.append(offset)
                out.append(record)
            return out

    def commit(self, records: Sequence[QueueRecord]) -> None:
        tops = commit_tops(records, self.lanes, self.partitions)
        with self._cond:
            for lane, top in tops.items():
                held = self._held.get(lane)
                done = 0
                while held and held[0] <= top:
                    held.popleft()
                    done += 1
                if held is not None and not held:
                    del self._held[lane]
                self._depth -= done + len(self._waiting.committed(lane, top))

    def depth(self) -> int:
        with self._cond:
            return self._depth

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
