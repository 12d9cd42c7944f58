"""How fast one project may start new runs at this gateway: a token bucket per project, so a tenant that
floods the server with tiny runs (each one a queue record, a run record and pipeline state of its own) is
answered 429 quickly instead of taking the processor's time from every other project.

Contract of :class:`NewRunLimiter` (thread-safe):

* :meth:`admit` ``(project, run_ids, now)`` -> ``None`` when every run id is known to this gateway or a token
  was taken for each new one; else the seconds until the bucket has enough tokens (the caller refuses the
  whole request with 429 and ``Retry-After``; nothing of it is queued, so the client's retry loses
  nothing). A request that is refused takes no tokens.
* The bucket refills at ``rate`` new runs per second up to ``burst``; ``rate <= 0`` turns the limit off.
* A run is *known* once admitted, remembered per project in a bounded least-recently-seen set of
  ``remember`` ids: a known run's events are never limited (a live run keeps sending whatever its project
  does). A run forgotten from that set and seen again costs one token again.
* Per gateway process: N gateway processes admit up to N times the rate (documented with the settings).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Dict, Iterable, Optional


class _Bucket:
    __slots__ = ("at_ns", "known", "tokens")

    def __init__(self, tokens: float, at_ns: int) -> None:
        self.tokens = tokens
        self.at_ns = at_ns
        self.known: OrderedDict[str, None] = OrderedDict()


class NewRunLimiter:
    """Token buckets of new runs per project (see the module doc)."""

    def __init__(self, rate: float, burst: int, remember: int) -> None:
        self.rate = rate
        self.burst = max(1, burst)
        self.remember = max(1, remember)
        self._buckets: Dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def admit(self, project: str, run_ids: Iterable[str], now_ns: int) -> Optional[float]:
        """None when admitted (tokens taken for the new runs), else seconds to wait before a retry."""
        if not self.enabled:
            return None
        with self._lock:
            bucket = self._buckets.get(project)
            if bucket is None:
                bucket = self._buckets[project] = _Bucket(float(self.burst), now_ns)
            known = bucket.known
            new = []
            for run_id in dict.fromkeys(run_ids):
                if run_id in known:
                    known.move_to_end(run_id)
                else:
                    new.append(run_id)
            if not new:
                return None
            elapsed = max(0, now_ns - bucket.at_ns) / 1e9
            bucket.tokens = min(float(self.burst), bucket.tokens + elapsed * self.rate)
            bucket.at_ns = now_ns
            if bucket.tokens < len(new):
                if len(new) > self.burst:  # never enough at once: wait for a full bucket
                    return self.burst / self.rate
                return (len(new) - bucket.tokens) / self.rate
            bucket.tokens -= len(new)
            for run_id in new:
                known[run_id] = None
            while len(known) > self.remember:
                known.popitem(last=False)
            return None
