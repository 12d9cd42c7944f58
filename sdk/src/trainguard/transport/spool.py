"""Where batches wait while the backend is unreachable: a bounded on-disk spool (or, without a spool
directory, a bounded in-memory one). Both are FIFO: batches are replayed in the order they were written.

Disk layout: one file per batch, ``<seq:012d>-<count>.json`` holding the exact HTTP ingest body, written to
a temporary name and renamed, so a process killed mid-write leaves no torn batch behind. The count in the
name lets eviction count the events it drops without reading the file.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

from ..core.events import decode_events, encode_batch

Batch = List[Dict[str, Any]]


class SpoolError(Exception):
    """The spool could not store a batch (disk full, permissions, ...)."""


class MemorySpool:
    """A bounded FIFO of batches in memory; evicts the oldest batch when over ``max_events``."""

    def __init__(self, max_events: int) -> None:
        self._batches: Deque[Batch] = deque()
        self._events = 0
        self._max_events = max(1, max_events)
        self.inherited = 0  # (DiskSpool's counters; a memory spool starts empty and reads back no file)
        self.discarded = 0

    def __len__(self) -> int:
        return len(self._batches)

    @property
    def events(self) -> int:
        return self._events

    def append(self, batch: Batch) -> int:
        """Store ``batch``; returns how many older events were evicted to make room."""
        evicted = 0
        while self._batches and self._events + len(batch) > self._max_events:
            oldest = self._batches.popleft()
            self._events -= len(oldest)
            evicted += len(oldest)
        self._batches.append(batch)
        self._events += len(batch)
        return evicted

    def peek(self) -> Optional[Batch]:
        """The oldest batch, or None."""
        return self._batches[0] if self._batches else None

    def pop(self) -> None:
        """Forget the oldest batch (it was delivered)."""
        if self._batches:
            self._events -= len(self._batches.popleft())

    def close(self) -> None:
        """Nothing to release."""


class DiskSpool:
    """A bounded FIFO of batches in ``directory``; evicts the oldest files when over ``max_bytes``.

    Files left by an earlier process in the same directory are picked up and replayed first
    (``inherited`` events). ``discarded`` counts the events of files that could not be read back.
    """

    def __init__(self, directory: str, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        os.makedirs(directory, exist_ok=True)
        self._files: Deque[Tuple[str, int, int]] = deque()  # (name, size, events)
        self._bytes = 0
        self._seq = 0
        for name in sorted(os.listdir(directory)):
            if name.endswith(".tmp"):
                _remove(os.path.join(directory, name))
                continue
            parsed = _parse_name(name)
            if parsed is None:
                continue
            seq, count = parsed
            try:
                size = os.path.getsize(os.path.join(directory, name))
            except OSError:
                continue
            self._files.append((name, size, count))
            self._bytes += size
            self._seq = max(self._seq, seq + 1)
        self.inherited = self.events
        self.discarded = 0

    def __len__(self) -> int:
        return len(self._files)

    @property
    def events(self) -> int:
        return sum(count for _, _, count in self._files)

    @property
    def bytes(self) -> int:
        return self._bytes

    def append(self, batch: Sequence[Dict[str, Any]]) -> int:
        """Write ``batch``; returns how many older events were evicted. Raises SpoolError if it can't."""
        body = encode_batch(batch)
        if len(body) > self.max_bytes:
            raise SpoolError(f"a batch of {len(body)} bytes exceeds spool_max_bytes={self.max_bytes}")
        evicted = 0
        while self._files and self._bytes + len(body) > self.max_bytes:
            evicted += self._drop_oldest()
        name = f"{self._seq:012d}-{len(batch)}.json"
        path = os.path.join(self.directory, name)
        tmp = path + ".tmp"
        try:
            with open(tmp, "wb") as fh:
                fh.write(body)
            os.replace(tmp, path)
        except OSError as exc:
            _remove(tmp)
            raise SpoolError(f"cannot write spool file {path}: {exc}") from None
        self._seq += 1
        self._files.append((name, len(body), len(batch)))
        self._bytes += len(body)
        return evicted

    def peek(self) -> Optional[Batch]:
        """The oldest batch, or None. A file that cannot be read or parsed is discarded."""
        while self._files:
            name = self._files[0][0]
            try:
                with open(os.path.join(self.directory, name), "rb") as fh:
                    return decode_events(fh.read())
            except (OSError, ValueError):
                self.discarded += self._drop_oldest()
        return None

    def pop(self) -> None:
        """Delete the oldest batch (it was delivered)."""
        if self._files:
            self._drop_oldest()

    def _drop_oldest(self) -> int:
        name, size, count = self._files.popleft()
        self._bytes -= size
        _remove(os.path.join(self.directory, name))
        return count

    def close(self) -> None:
        """Remove the directory if it is empty (nothing left to replay)."""
        if not self._files:
            try:
                os.rmdir(self.directory)
            except OSError:
                pass


def _parse_name(name: str) -> Optional[Tuple[int, int]]:
    stem, _dot, ext = name.partition(".")
    if ext != "json" or "-" not in stem:
        return None
    seq, _, count = stem.partition("-")
    if not (seq.isdigit() and count.isdigit()):
        return None
    return int(seq), int(count)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
