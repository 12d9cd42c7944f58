"""Counters of what the SDK did with events: sent, spooled, retried and dropped (by reason).

Every event is accounted for: ``drained + dropped["queue_full"]`` (plus what is still queued) is what was
logged, and once nothing is queued or in flight, ``sent + spooled + dropped == logged`` exactly
(:meth:`trainguard.client.Client.accounting`). ``sent``, ``spooled`` and ``drained`` change on the worker
thread only. Drops at the door (the queue full, on the calling thread, possibly in a tight loop) are counted
without a lock by :meth:`SdkStats.door_drop` (an ``itertools.count``: one C call, atomic under the GIL) and
folded into ``dropped["queue_full"]`` when ``dropped`` is read; other drops are counted under a lock (they
come from any thread, and only on the slow path), so no increment is lost. Snapshots are reported in
heartbeats, as ``trainguard/sdk/*`` metrics and in the exit event.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from typing import Callable, Dict

DROP_REASONS = (
    "queue_full",        # the in-memory queue was full when the event was produced
    "invalid_value",     # a metric VALUE that is not a number (None, a string, a non-scalar tensor): counts
                         # values, not events (the event goes out without it), so not in dropped_total
    "encode_error",      # the event could not be built or serialised (e.g. a tensor that cannot be read)
    "rejected",          # the server refused the event (4xx / per-item rejection)
    "spool_full",        # evicted from the disk spool to stay within spool_max_bytes
    "spool_error",       # the spool could not be written (disk full, permissions)
    "send_failed",       # undeliverable and no spool to keep it in
    "shutdown",          # still queued or in flight when shutdown's timeout ran out (spool not writable)
    "device_stalled",    # device metrics waiting behind a read-back the device never completed
)


VALUE_REASONS = ("invalid_value",)
"""Drop reasons that count metric values rather than events."""


class SdkStats:
    """Counters; ``snapshot()`` gives a plain dict for reporting.

    ``sent``: events the backend acknowledged (accepted or already stored), replayed ones included;
    ``spooled``: events held in the spool now, waiting for replay (a gauge); ``replayed``: events delivered
    from the spool; ``drained``: events the worker took from the queue (and any that an earlier process
    left in the spool); ``dropped``: events given up on, by reason (and invalid values, see DROP_REASONS).
    """

    def __init__(self) -> None:
        self._dropped: Counter[str] = Counter()
        self.sent = 0
        self.spooled = 0
        self.replayed = 0
        self.retries = 0
        self.batches = 0
        self.drained = 0
        self._lock = threading.Lock()
        self._door = itertools.count()
        self._door_taken = 0  # values of _door already accounted for (door drops folded + folds)
        self.door_drop: Callable[[], int] = self._door.__next__
        """Record one event dropped at the door (queue full): lock-free, the hot path of a full queue."""

    def drop(self, reason: str, count: int = 1) -> None:
        """Record ``count`` events dropped for ``reason`` (one of DROP_REASONS)."""
        with self._lock:
            self._dropped[reason] += count

    @property
    def dropped(self) -> Counter[str]:
        """Events dropped by reason, the door's count folded into ``queue_full`` (exact when read)."""
        with self._lock:
            taken = next(self._door)  # == door drops + earlier folds' own values
            door = taken - self._door_taken
            self._door_taken = taken + 1
            if door:
                self._dropped["queue_full"] += door
            return self._dropped

    @property
    def dropped_total(self) -> int:
        """Events dropped, all reasons (invalid values are not events: see VALUE_REASONS)."""
        return sum(n for reason, n in list(self.dropped.items()) if reason not in VALUE_REASONS)

    def snapshot(self) -> Dict[str, float]:
        """Counters as a flat ``{name: value}`` dict."""
        out: Dict[str, float] = {
            "sent": float(self.sent),
            "spooled": float(self.spooled),
            "replayed": float(self.replayed),
            "retries": float(self.retries),
            "batches": float(self.batches),
            "dropped": float(self.dropped_total),
        }
        for reason, count in list(self.dropped.items()):
            out["dropped." + reason] = float(count)
        return out
