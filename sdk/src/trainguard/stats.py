"""Counters of what the SDK did with events: sent, spooled, retried and dropped (by reason).

Increments happen from the training thread and the worker; a lost increment under a race is acceptable
(these are diagnostics), a lock on the step path is not. Snapshots are reported in heartbeats, as
``trainguard/sdk/*`` metrics and in the exit event.
"""

from __future__ import annotations

from collections import Counter
from typing import Dict

DROP_REASONS = (
    "queue_full",        # the in-memory queue was full when the event was produced
    "invalid_value",     # a metric value that is not a number (None, a string, a non-scalar tensor)
    "encode_error",      # the event could not be serialised
    "rejected",          # the server refused the event (4xx / per-item rejection)
    "spool_full",        # evicted from the disk spool to stay within spool_max_bytes
    "spool_error",       # the spool could not be written (disk full, permissions)
    "send_failed",       # undeliverable and no spool to keep it in
    "shutdown",          # still queued when shutdown's timeout ran out
    "device_stalled",    # device metrics waiting behind a read-back the device never completed
)


class SdkStats:
    """Monotonic counters; ``snapshot()`` gives a plain dict for reporting."""

    def __init__(self) -> None:
        self.dropped: Counter[str] = Counter()
        self.sent = 0
        self.spooled = 0
        self.replayed = 0
        self.retries = 0
        self.batches = 0

    def drop(self, reason: str, count: int = 1) -> None:
        """Record ``count`` events dropped for ``reason`` (one of DROP_REASONS)."""
        self.dropped[reason] += count

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

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
        for reason, count in self.dropped.items():
            out["dropped." + reason] = float(count)
        return out
