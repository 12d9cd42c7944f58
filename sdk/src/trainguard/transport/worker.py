"""The background worker: drains the client's queue on a daemon thread and delivers batches.

Delivery rules (DESIGN §2 rule 5):
- the training thread never waits for the network: it only appends to a bounded queue;
- a batch that cannot be delivered goes to the spool (disk, or bounded memory when spooling is off) and is
  replayed, oldest first, once the backend answers again; while anything is spooled, new batches queue
  behind it so order is preserved;
- retryable failures back off exponentially (with jitter), never shorter than the server's Retry-After;
- every event that is given up on is counted in :class:`~trainguard.stats.SdkStats` by reason.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Protocol, Union

from ..guard import warn_once
from ..options import Options
from ..stats import SdkStats
from .base import SendResult, Transport, TransportError
from .spool import DiskSpool, MemorySpool, SpoolError

Spool = Union[DiskSpool, MemorySpool]
Event = Dict[str, Any]


class EventSource(Protocol):
    """What the worker drains: implemented by :class:`trainguard.client.Client`."""

    def drain(self, max_events: int) -> List[Event]:
        """Up to ``max_events`` envelopes, oldest first; [] when nothing is queued."""

    def pending(self) -> int:
        """How many items wait in the queue."""

    def tick(self) -> None:
        """Periodic work on the worker thread (heartbeats, stats)."""


class Worker:
    """Owns the delivery thread, the transport, the spool and the backoff state."""

    def __init__(self, source: EventSource, transport_factory: Callable[[], Transport],
                 spool_factory: Callable[[], Spool], options: Options, stats: SdkStats) -> None:
        self._source = source
        self._transport_factory = transport_factory
        self._spool_factory = spool_factory
        self._options = options
        self.stats = stats
        self._transport: Optional[Transport] = None
        self._spool: Optional[Spool] = None
        self._wake = threading.Event()
        self._cond = threading.Condition()
        self._flush_requested = 0
        self._flush_done = 0
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self._backoff = 0.0
        self._retry_at = 0.0
        self._final_failed = False

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the daemon thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(target=self._run, name="trainguard-worker", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def flushing(self) -> bool:
        """A :meth:`flush` is waiting for what is queued."""
        return self._flush_requested > self._flush_done

    def wake(self) -> None:
        """Ask the worker to look at the queue now rather than at the next interval."""
        self._wake.set()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until everything queued so far was delivered or spooled.

        Returns True when the queue and the spool are both empty (everything was acknowledged).
        """
        if not self.alive:
            self.start()
        with self._cond:
            self._flush_requested += 1
            generation = self._flush_requested
        self._wake.set()
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while self._flush_done < generation:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return self._source.pending() == 0 and (self._spool is None or len(self._spool) == 0)

    def close(self, timeout: float) -> bool:
        """Deliver what is queued (or spool it) within ``timeout`` s, then stop. Returns True if drained."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(max(0.0, timeout))
        drained = not self.alive
        if not drained:
            self.stats.drop("shutdown", self._source.pending())
        if self._transport is not None:
            self._transport.close()
        if self._spool is not None and drained:
            self._spool.close()
        return drained

    def reset_after_fork(self) -> None:
        """In a forked child: no thread, no inherited connection, spool and locks of our own."""
        self._thread = None
        self._transport = None
        self._spool = None
        self._wake = threading.Event()
        self._cond = threading.Condition()
        self._flush_requested = self._flush_done = 0
        self._backoff = self._retry_at = 0.0

    # --- the loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            timeout = self._options.flush_interval
            if self._retry_at:
                timeout = min(timeout, max(0.01, self._retry_at - time.monotonic()))
            self._wake.wait(timeout)
            self._wake.clear()
            with self._cond:
                generation = self._flush_requested
            stopping = self._stopping
            try:
                if not stopping:
                    self._source.tick()
                self._pump(final=stopping)
            except Exception as exc:  # never let the worker die silently
                warn_once(f"worker:{type(exc).__name__}",
                          f"delivery error {type(exc).__name__}: {exc}; continuing")
            with self._cond:
                self._flush_done = max(self._flush_done, generation)
                self._cond.notify_all()
            if stopping:
                return

    def _pump(self, final: bool) -> None:
        self._replay(final)
        while True:
            events = self._source.drain(self._options.max_batch_events)
            if not events:
                return
            self._deliver(events, final)

    # --- delivery -------------------------------------------------------------------------------
    def _in_backoff(self, final: bool) -> bool:
        if final:
            return self._final_failed
        return self._retry_at > time.monotonic()

    def _get_transport(self) -> Transport:
        if self._transport is None:
            self._transport = self._transport_factory()
        return self._transport

    def _get_spool(self) -> Spool:
        if self._spool is None:
            try:
                self._spool = self._spool_factory()
            except (OSError, SpoolError) as exc:
                warn_once("spool:create", f"cannot create the disk spool ({exc}); buffering in memory")
                self._spool = MemorySpool(self._options.max_queue_events)
        return self._spool

    def _deliver(self, events: List[Event], final: bool) -> None:
        spool = self._spool
        if (spool is not None and len(spool) > 0) or self._in_backoff(final):
            self._to_spool(events)
            return
        try:
            result = self._get_transport().send(events, self._options.send_timeout)
        except TransportError as exc:
            self._on_failure(exc, events, final)
            return
        self._on_success(result, len(events))

    def _on_failure(self, exc: TransportError, events: List[Event], final: bool) -> None:
        if exc.retryable:
            self.stats.retries += 1
            self._schedule_retry(exc)
            if final:
                self._final_failed = True
            warn_once(f"send:{exc.status}", f"backend unreachable ({exc}); spooling and retrying")
            self._to_spool(events)
        elif exc.status == "413" and len(events) > 1:
            half = len(events) // 2
            self._deliver(events[:half], final)
            self._deliver(events[half:], final)
        else:
            self.stats.drop("rejected", len(events))
            warn_once(f"rejected:{exc.status}", f"backend rejected a batch of {len(events)}: {exc}")

    def _on_success(self, result: SendResult, count: int) -> None:
        self._backoff = 0.0
        self._retry_at = 0.0
        self.stats.batches += 1
        self.stats.sent += count - len(result.rejected)
        if result.rejected:
            self.stats.drop("rejected", len(result.rejected))
            first = result.rejected[0]
            warn_once(f"item:{first.get('code')}",
                      f"backend rejected {len(result.rejected)} event(s): {first.get('message')}")

    def _schedule_retry(self, exc: TransportError) -> None:
        opts = self._options
        self._backoff = min(opts.backoff_max, max(opts.backoff_initial, self._backoff * 2))
        delay = self._backoff * (0.5 + random.random() / 2)
        if exc.retry_after is not None:
            delay = max(delay, exc.retry_after)
        self._retry_at = time.monotonic() + delay

    def _to_spool(self, events: List[Event]) -> None:
        spool = self._get_spool()
        try:
            evicted = spool.append(events)
        except SpoolError as exc:
            self.stats.drop("spool_error", len(events))
            warn_once("spool:write", f"spool write failed ({exc}); dropping events (counted)")
            return
        self.stats.spooled += len(events)
        if evicted:
            self.stats.drop("spool_full", evicted)
            warn_once("spool:full", "spool is full; evicting the oldest batches (counted)")

    def _replay(self, final: bool) -> None:
        spool = self._spool
        while spool is not None and len(spool) > 0 and not self._in_backoff(final):
            batch = spool.peek()
            if batch is None:
                return
            try:
                result = self._get_transport().send(batch, self._options.send_timeout)
            except TransportError as exc:
                if exc.retryable:
                    self.stats.retries += 1
                    self._schedule_retry(exc)
                    if final:
                        self._final_failed = True
                    return
                spool.pop()
                self.stats.drop("rejected", len(batch))
                warn_once(f"rejected:{exc.status}", f"backend rejected a spooled batch: {exc}")
                continue
            spool.pop()
            self.stats.replayed += len(batch)
            self._on_success(result, len(batch))
