"""The Transport contract: deliver one batch of envelope dicts, synchronously, from the worker thread.

Transports never run on the training thread: only :class:`trainguard.transport.worker.Worker` calls them.
They report failure by raising :class:`TransportError`, which tells the worker whether a retry can help
and how long the server asked it to wait.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence


@dataclass
class SendResult:
    """What the server said about a batch that it acknowledged (HTTP 200 / gRPC OK)."""

    accepted: int = 0
    duplicates: int = 0
    rejected: List[Dict[str, Any]] = field(default_factory=list)  # {"index", "event_id", "code", "message"}


class TransportError(Exception):
    """A batch was not acknowledged.

    ``retryable``: the same batch may succeed later (connection refused, timeout, 5xx, 429,
    RESOURCE_EXHAUSTED, UNAVAILABLE). Not retryable: the server rejected the batch itself (400, 401, 403,
    413, INVALID_ARGUMENT, UNAUTHENTICATED ...), so re-sending it would fail again.
    ``retry_after``: seconds the server asked us to wait (Retry-After), if it said.
    """

    def __init__(self, message: str, *, retryable: bool, retry_after: Optional[float] = None,
                 status: Optional[str] = None) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.retry_after = retry_after
        self.status = status


class Transport(ABC):
    """Sends batches to one endpoint. Instances are used from a single thread (the worker)."""

    #: short name for stats and warnings: "http", "grpc", "file"
    name: str = "transport"

    @abstractmethod
    def send(self, events: Sequence[Dict[str, Any]], timeout: float) -> SendResult:
        """Deliver ``events`` (envelope dicts in the JSON mapping) within ``timeout`` seconds.

        Returns only once the server acknowledged the batch; raises TransportError otherwise.
        """

    def abort(self) -> None:
        """Interrupt a :meth:`send` in progress on another thread: it raises a retryable TransportError
        (status ``"aborted"``) promptly. Called by the worker's shutdown when its time is up; safe to call
        from any thread, at any time, any number of times. Default: sends never block, nothing to do."""

    def close(self) -> None:
        """Release connections. Safe to call twice."""


def check_ack(accepted: Any, duplicates: Any, rejected_indexes: Sequence[Any], count: int) -> None:
    """Raise a retryable TransportError (status ``"bad_ack"``) unless this answer acknowledges all ``count``
    events of the request: integer counts >= 0, rejections with distinct integer indexes that are
    positions in the request, and ``accepted + duplicates + len(rejected) == count`` (the gateway answers
    for every event it was sent). Anything else was not really accepted -- a proxy's page, a wrong
    server, a truncated answer -- so the batch is kept and retried (the gateway's de-duplication by
    event_id makes a retry of what did arrive harmless)."""
    problem = _ack_problem(accepted, duplicates, rejected_indexes, count)
    if problem:
        raise TransportError(f"the backend answered 200 but not with an acknowledgement of the batch: "
                             f"{problem}", retryable=True, status="bad_ack")


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _ack_problem(accepted: Any, duplicates: Any, rejected_indexes: Sequence[Any], count: int) -> str:
    if not (_is_count(accepted) and _is_count(duplicates)):
        return f"accepted={accepted!r}, duplicates={duplicates!r} are not counts"
    if not all(type(i) is int and 0 <= i < count for i in rejected_indexes):
        return f"rejected indexes {list(rejected_indexes)[:5]!r} are not positions in a batch of {count}"
    if len(set(rejected_indexes)) != len(rejected_indexes):
        return "an event is rejected twice"
    answered = accepted + duplicates + len(rejected_indexes)
    if answered != count:
        return f"it answers for {answered} event(s), the batch had {count}"
    return ""


def parse_retry_after(value: Optional[str]) -> Optional[float]:
    """Seconds from a Retry-After header / metadata value (delta-seconds form only); None if absent/bad."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except (TypeError, ValueError):
        return None
    if seconds != seconds or seconds < 0:
        return None
    return min(seconds, 300.0)
