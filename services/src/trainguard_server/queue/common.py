"""Argument checks and offset bookkeeping every queue implementation shares (SQLite, Kafka, memory), so
all of them refuse the same bad calls with the same messages."""

from __future__ import annotations

from typing import Sequence

from .base import QueueRecord

PARTITION = 0


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


def check_publish_args(key: str, values: Sequence[bytes]) -> None:
    if not isinstance(key, str):
        raise TypeError("key must be a str")
    for value in values:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError("values must be bytes")
