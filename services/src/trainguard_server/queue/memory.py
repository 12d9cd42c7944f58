"""MemoryQueue: the queue contract in a deque — bounded, ordered, one partition (0), not durable.

For tests and for a server that may lose unprocessed batches on a crash. ``publish`` raises QueueFull when
``max_depth`` records are uncommitted (the call that crosses the line is accepted whole, so a batch is never
split); a consumer blocked in ``consume`` wakes as soon as something is published or the queue is closed.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Deque, List, Sequence

from .base import Queue, QueueFull, QueueRecord
from .common import PARTITION, check_consume_args, check_publish_args, commit_offset


class MemoryQueue(Queue):
    """Bounded in-memory queue; offsets start at 0 and are never reused."""

    def __init__(self, max_depth: int = 50_000, *, retry_after: float = 1.0) -> None:
        if max_depth < 1:
            raise ValueError("max_depth must be >= 1")
        self._max_depth = max_depth
        self._retry_after = retry_after
        self._cond = threading.Condition()
        self._records: Deque[QueueRecord] = deque()  # uncommitted, in offset order
        self._next_offset = 0
        self._handed = -1                             # highest offset handed out
        self._closed = False

    def publish(self, key: str, values: Sequence[bytes]) -> List[int]:
        check_publish_args(key, values)
        with self._cond:
            if self._closed:
                raise RuntimeError("queue is closed")
            if len(self._records) >= self._max_depth:
                raise QueueFull(f"queue holds {len(self._records)} unprocessed records "
                                f"(max {self._max_depth})", retry_after=self._retry_after)
            now = time.time_ns()
            offsets = []
            for value in values:
                record = QueueRecord(partition=PARTITION, offset=self._next_offset, key=key,
                                     value=bytes(value), published_ns=now)
                self._records.append(record)
                offsets.append(self._next_offset)
                self._next_offset += 1
            if offsets:
                self._cond.notify_all()
            return offsets

    def consume(self, max_records: int, timeout: float) -> List[QueueRecord]:
        check_consume_args(max_records, timeout)
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._closed and self._next_offset - 1 <= self._handed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._cond.wait(remaining)
            out = [r for r in self._records if r.offset > self._handed][:max_records]
            if out:
                self._handed = out[-1].offset
            return out

    def commit(self, records: Sequence[QueueRecord]) -> None:
        top = commit_offset(records)
        with self._cond:
            while self._records and self._records[0].offset <= top:
                self._records.popleft()
            self._handed = max(self._handed, top)

    def depth(self) -> int:
        with self._cond:
            return len(self._records)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
