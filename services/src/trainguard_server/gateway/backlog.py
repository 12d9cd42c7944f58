"""How many of one project's events may wait in the queue for this process's processor: a bound per
project, so a tenant sending faster than the processor works cannot push every other project's events back
behind its own (the queue is first come, first served: without it, one project's flood delayed another's
NaN-loss incident from 0.4 s to ~28 s -- docs/security.md).

Contract of :class:`ProjectBacklog` (thread-safe):

* :meth:`admit` ``(project, events)`` -> ``None`` when admitted (the events are counted as waiting), else the
  seconds a client should wait (the caller refuses the whole request with 429 and ``Retry-After`` before
  anything of it is queued, so the client's retry loses nothing). A project with nothing waiting is always
  admitted: one request larger than the bound goes through alone.
* :meth:`full` ``(project)`` -- the project is at its bound: the gateway refuses its requests right after
  authenticating them, before decoding (a flood refused anyway costs no decoding or validation).
* :meth:`release` ``(project, events)`` -- events of the project that left the queue: the processor's
  :meth:`processed` hook after each chunk it processed, or the gateway for events it counted and then could
  not publish.
* Counts can only be too high when a record's events are never processed (a record the processor cannot
  decode): when a project is over its bound and ``depth()`` (the queue's unconsumed records) is 0, every
  count is reset.
* A metric batch counts one per point (at least one): the processor's work grows with the points, and a
  project sending a few envelopes of 5,000 points each (20 runs of 5,000 metric names per step) queued 100,000
  points per request while counted as 20 events, so the bound never held it and another project's
  NaN-loss incident waited 7-12 s behind it. :func:`weight` (a ``trainguard.v1.Envelope``) and
  :func:`dict_weight` (its JSON mapping) agree; the processor hands :meth:`processed` the weights of a chunk
  summed per project.
* ``limit <= 0`` turns it off. It needs the gateway, the processor and the queue in one process
  (``trainguard serve``'s defaults: the embedded SQLite queue); gateway processes apart from the processors
  (split mode) and a Kafka queue, which other processes may consume, are not counted.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Mapping, Optional


def weight(envelope: Any) -> int:
    """What one envelope (a ``trainguard.v1.Envelope``) counts: its metric points, at least 1."""
    if envelope.WhichOneof("payload") != "metrics":
        return 1
    return max(1, len(envelope.metrics.points))


def dict_weight(envelope: Mapping[str, Any]) -> int:
    """:func:`weight` of an envelope in the JSON mapping."""
    metrics = envelope.get("metrics")
    if not isinstance(metrics, Mapping):
        return 1
    points = metrics.get("points")
    return max(1, len(points)) if isinstance(points, (list, tuple)) else 1


class ProjectBacklog:
    """Events per project between the gateway's publish and the processor's chunk (see the module doc)."""

    def __init__(self, limit: int, retry_after_s: float, depth: Callable[[], int]) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self._depth = depth
        self._waiting: Dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def waiting(self, project: str) -> int:
        """The project's events counted as waiting now."""
        with self._lock:
            return self._waiting.get(project, 0)

    def full(self, project: str) -> bool:
        """True while the project is at its bound (checked before a request is decoded: a flood that is
        refused anyway costs no decoding or validation)."""
        if not self.enabled:
            return False
        with self._lock:
            return self._waiting.get(project, 0) >= self.limit and not self._cleared_if_stale()

    def admit(self, project: str, events: int) -> Optional[float]:
        """None when admitted (counted), else seconds to wait before a retry."""
        if not self.enabled or events <= 0:
            return None
        with self._lock:
            now = self._waiting.get(project, 0)
            if now and now + events > self.limit:
                if not self._cleared_if_stale():
                    return self.retry_after_s
                now = 0
            self._waiting[project] = now + events
            return None

    def _cleared_if_stale(self) -> bool:
        """(Under the lock.) When the queue is empty, what is counted is stale: clear it, True."""
        if self._depth() > 0:
            return False
        self._waiting.clear()
        return True

    def release(self, project: str, events: int) -> None:
        """``events`` of ``project`` left the queue (processed, or never published)."""
        if not self.enabled or events <= 0:
            return
        with self._lock:
            left = self._waiting.get(project, 0) - events
            if left > 0:
                self._waiting[project] = left
            else:
                self._waiting.pop(project, None)

    def processed(self, counts: Mapping[str, int]) -> None:
        """The processor's hook: a chunk went through, ``{project: events}`` -- each envelope weighed as
        :func:`weight` / :func:`dict_weight` weigh it, summed per project (the processor knows each
        envelope's project and points without rendering its dict: processor/embedded.backlog_counts)."""
        if not self.enabled:
            return
        for project, n in counts.items():
            self.release(project, n)
