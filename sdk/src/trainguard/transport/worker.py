"""The background worker: drains the client's queue on a daemon thread and delivers batches.

Delivery rules (DESIGN §2 rule 5):
- the training thread never waits for the network: it only appends to a bounded queue;
- a batch that cannot be delivered goes to the spool (disk, or bounded memory when spooling is off) and is
  replayed, oldest first, once the backend answers again; while anything is spooled, new batches queue
  behind it so order is preserved;
- retryable failures back off exponentially (with jitter), never shorter than the server's Retry-After;
- every event is accounted for in :class:`~trainguard.stats.SdkStats`: sent, held in the spool, or dropped
  by reason; the worker is the only writer of ``sent`` / ``spooled`` / ``replayed``.

Spools of dead processes (:mod:`.orphans`: a rank killed by SIGKILL, an abort, a native crash, or one that
exited with its backend down) are adopted when the worker starts and every ``orphan_scan_interval`` seconds,
and replayed after this process's own events, a few batches per pass; at shutdown they are let go again
(unlocked, for the next process). Urgent events written ahead (:class:`~.home.WriteAhead`) are settled
(``settle``) once their batch was acknowledged, rejected or spooled.

Shutdown (:meth:`Worker.close`) is bounded by its timeout: the final delivery may use the network for
``SHUTDOWN_NETWORK_SHARE`` of it (each request's deadline is cut to fit); then a request still in flight is
aborted and everything left -- the batch that was in flight, the queue -- is written to the spool in the
time that remains. Only a worker that is still stuck at the deadline (a spool disk that does not answer) is
abandoned; the client then counts what it had not settled as ``dropped.shutdown``.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Protocol, Sequence, Tuple, Union

from ..guard import warn_once
from ..options import Options
from ..stats import SdkStats
from .base import SendResult, Transport, TransportError
from .orphans import Orphan
from .spool import DiskSpool, MemorySpool, SpoolError

Spool = Union[DiskSpool, MemorySpool]
Event = Dict[str, Any]

SHUTDOWN_NETWORK_SHARE = 0.8
"""Share of the shutdown timeout the final delivery may spend talking to the backend; the rest is kept
for writing what is left to the spool (local disk: milliseconds for a full queue)."""
_SHUTDOWN_STATUSES = ("shutdown", "aborted")  # a send cut short by shutdown, not a verdict on the backend
ORPHAN_BATCHES_PER_PASS = 4
"""Batches of dead processes' spools replayed per pass of the worker, after this process's own events, so
that a large one never holds this process's alerts back; passes follow each other quickly while any is
left (:data:`ORPHAN_PASS_WAIT_S`)."""
ORPHAN_PASS_WAIT_S = 0.05
ALL_REJECTED_AFTER = 50
"""Events refused with none accepted after which the SDK says, once, that nothing of the job arrives."""
RETRY_AFTER_SPREAD = 0.5
"""A server's Retry-After is honoured (never sooner) and spread over up to this share more at random, so
the ranks of a large job refused together (e.g. a project's waiting-call bound, security.md H37) do not all
come back at the same instant, every Retry-After, as one herd."""


def retry_delay(backoff: float, retry_after: Optional[float],
                draw: Callable[[], float] = random.random) -> float:
    """Seconds before the next try: the jittered backoff (half to all of ``backoff``), or, when the server
    named a Retry-After, at least that and up to :data:`RETRY_AFTER_SPREAD` more, whichever is later."""
    delay = backoff * (0.5 + draw() / 2)
    if retry_after is not None:
        delay = max(delay, retry_after * (1.0 + RETRY_AFTER_SPREAD * draw()))
    return delay


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
                 spool_factory: Callable[[], Spool], options: Options, stats: SdkStats, *,
                 settle: Callable[[Sequence[Event]], None] = lambda events: None,
                 find_orphans: Callable[[], List[Orphan]] = lambda: []) -> None:
        self._source = source
        self._transport_factory = transport_factory
        self._spool_factory = spool_factory
        self._settle = settle
        self._find_orphans = find_orphans
        self._orphans: Deque[Tuple[Orphan, DiskSpool]] = deque()
        self._next_scan = 0.0  # time.monotonic() of the next look for dead processes' spools
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
        self._first_rejection = ""  #: the backend's reason for the first event it refused
        self._net_deadline = 0.0  # shutdown: no request may run past this (time.monotonic())
        self._counting = threading.Lock()  # serialises the worker's counts with close() abandoning it
        self._abandoned = False

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

    @property
    def spool_location(self) -> Optional[str]:
        """The spool's directory (None: no disk spool opened)."""
        return getattr(self._spool, "directory", None)

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
        """Deliver what is queued, or spool it, within ``timeout`` s, then stop (see the module doc).

        Returns True when the worker finished: everything it held was sent, spooled or counted. False: it
        was still stuck at the deadline and is abandoned -- it counts nothing more, and the caller counts
        what it had not settled as dropped.
        """
        started = time.monotonic()
        timeout = max(0.0, timeout)
        deadline = started + timeout
        self._net_deadline = started + timeout * SHUTDOWN_NETWORK_SHARE
        self._stopping = True
        self._wake.set()
        thread = self._thread
        if thread is not None:
            thread.join(max(0.0, self._net_deadline - time.monotonic()))
            if thread.is_alive():  # a request still in flight: cut it short, the worker spools the rest
                transport = self._transport
                if transport is not None:
                    transport.abort()
                thread.join(max(0.0, deadline - time.monotonic()))
        finished = not self.alive
        if not finished:
            with self._counting:
                self._abandoned = True
            warn_once("shutdown:stuck", f"the delivery thread was still busy after {timeout:g} s "
                                        f"(shutdown_timeout); what it held is counted as dropped.shutdown")
        if self._transport is not None:
            self._transport.close()
        refused = self.stats.dropped.get("rejected", 0)
        if refused:
            warn_once("shutdown:rejected", f"the backend rejected {refused} of the "
                                           f"{refused + self.stats.sent} event(s) this process sent "
                                           f"(first reason: {self._first_rejection}); they are not stored")
        if self._spool is not None and finished:
            left = self._spool.events
            if left:
                where = f" at {self.spool_location}" if self.spool_location else ""
                warn_once("shutdown:spooled", f"{left} event(s) could not be delivered before shutdown "
                                              f"(backend down or not answering); kept in the spool{where}")
            self._spool.close()
        if finished:
            self._let_orphans_go()
        return finished

    def reset_after_fork(self) -> None:
        """In a forked child: no thread, no inherited connection, spool and locks of our own."""
        self._thread = None
        self._transport = None
        self._spool = None
        self._wake = threading.Event()
        self._cond = threading.Condition()
        self._counting = threading.Lock()
        self._flush_requested = self._flush_done = 0
        self._backoff = self._retry_at = 0.0
        self._orphans = deque()  # the parent's locks: not ours to release (closing ours would not either)
        self._next_scan = 0.0

    # --- the loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            timeout = self._options.flush_interval
            if self._retry_at:
                timeout = min(timeout, max(0.01, self._retry_at - time.monotonic()))
            elif self._orphans:
                timeout = min(timeout, ORPHAN_PASS_WAIT_S)
            self._wake.wait(timeout)
            self._wake.clear()
            with self._cond:
                generation = self._flush_requested
            stopping = self._stopping
            try:
                if not stopping:
                    self._source.tick()
                    self._adopt_orphans()
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
        self._replay(self._spool, final)
        while not self._abandoned:
            events = self._source.drain(self._options.max_batch_events)
            if not events:
                break
            self._deliver(events, final)
        if not final:
            self._replay_orphans()

    # --- dead processes' spools -----------------------------------------------------------------
    def _adopt_orphans(self) -> None:
        """Look for dead processes' spools when due (worker thread); adopted ones count as spooled."""
        now = time.monotonic()
        if now < self._next_scan:
            return
        interval = self._options.orphan_scan_interval
        self._next_scan = now + interval if interval > 0 else float("inf")
        known = {orphan.directory for orphan, _ in self._orphans}
        for orphan in self._find_orphans():
            if orphan.directory in known:
                continue
            try:
                spool = orphan.spool()
            except OSError:
                orphan.release()
                continue
            if not len(spool):
                orphan.release()
                continue
            with self._counting:  # logged by a dead process, accounted for here (as an own inherited spool)
                self.stats.drained += spool.inherited
                self.stats.spooled += spool.inherited
            self._orphans.append((orphan, spool))

    def _replay_orphans(self) -> None:
        """Up to ORPHAN_BATCHES_PER_PASS batches of the adopted spools, oldest spool first."""
        budget = ORPHAN_BATCHES_PER_PASS
        while self._orphans and budget > 0 and not self._abandoned:
            orphan, spool = self._orphans[0]
            if not self._replay(spool, False, max_batches=1):
                return
            budget -= 1
            if len(spool) == 0:
                self._orphans.popleft()
                spool.close()
                orphan.release()

    def _let_orphans_go(self) -> None:
        """Unlock what is left of the adopted spools: the next process (or the agent) delivers it."""
        while self._orphans:
            orphan, spool = self._orphans.popleft()
            with self._counting:  # no longer held here
                self.stats.drained -= spool.events
                self.stats.spooled -= spool.events
            orphan.release()

    # --- accounting -----------------------------------------------------------------------------
    def _count(self, *, sent: int = 0, spooled: int = 0, replayed: int = 0,
               drops: Sequence[Tuple[str, int]] = ()) -> None:
        """Apply one outcome to the stats, unless close() abandoned this worker (it counted for us)."""
        with self._counting:
            if self._abandoned:
                return
            stats = self.stats
            stats.sent += sent
            stats.spooled += spooled
            stats.replayed += replayed
            for reason, count in drops:
                if count:
                    stats.drop(reason, count)

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
                spool: Spool = self._spool_factory()
            except (OSError, SpoolError) as exc:
                warn_once("spool:create", f"cannot create the disk spool ({exc}); buffering in memory")
                spool = MemorySpool(self._options.max_queue_events)
            self._spool = spool
            if spool.inherited:  # an earlier process's batches: logged there, accounted for here
                with self._counting:
                    self.stats.drained += spool.inherited
                    self.stats.spooled += spool.inherited
        return self._spool

    def _send(self, events: Sequence[Event]) -> SendResult:
        """One request, within send_timeout -- and, once stopping, within the shutdown's network time."""
        timeout = self._options.send_timeout
        if self._stopping:
            left = self._net_deadline - time.monotonic()
            if left <= 0:
                raise TransportError("shutdown: no time left to deliver", retryable=True, status="shutdown")
            timeout = min(timeout, left)
        return self._get_transport().send(events, timeout)

    def _deliver(self, events: List[Event], final: bool) -> None:
        spool = self._spool
        if (spool is not None and len(spool) > 0) or self._in_backoff(final):
            self._to_spool(events)
            return
        try:
            result = self._send(events)
        except TransportError as exc:
            self._on_failure(exc, events, final)
            return
        self._on_success(result, len(events))
        self._settle(events)

    def _on_failure(self, exc: TransportError, events: List[Event], final: bool) -> None:
        if exc.retryable:
            if final or self._stopping:
                self._final_failed = True
            if exc.status in _SHUTDOWN_STATUSES and self._stopping:
                self._to_spool(events)
                return
            self.stats.retries += 1
            self._schedule_retry(exc)
            warn_once(f"send:{exc.status}", f"backend unreachable ({exc}); spooling and retrying")
            self._to_spool(events)
        elif exc.status == "413" and len(events) > 1:
            half = len(events) // 2
            self._deliver(events[:half], final)
            self._deliver(events[half:], final)
        else:
            self._count(drops=[("rejected", len(events))])
            self._settle(events)
            warn_once(f"rejected:{exc.status}", f"backend rejected a batch of {len(events)}: {exc}")
            self._note_rejected(str(exc))

    def _on_success(self, result: SendResult, count: int, replayed: bool = False) -> None:
        self._backoff = 0.0
        self._retry_at = 0.0
        self.stats.batches += 1
        rejected = len(result.rejected)
        self._count(sent=count - rejected, spooled=-count if replayed else 0,
                    replayed=count if replayed else 0, drops=[("rejected", rejected)])
        if result.rejected:
            first = result.rejected[0]
            warn_once(f"item:{first.get('code')}",
                      f"backend rejected {rejected} event(s): {first.get('message')}")
            self._note_rejected(str(first.get("message")))

    def _note_rejected(self, reason: str) -> None:
        """After a rejection: once ``ALL_REJECTED_AFTER`` events were refused and none accepted, one loud line
        (a wrong project or token refuses every event, and the per-reason line above said it only once)."""
        if not self._first_rejection:
            self._first_rejection = reason
        refused = self.stats.dropped.get("rejected", 0)
        if self.stats.sent == 0 and refused >= ALL_REJECTED_AFTER:
            warn_once("rejected:all", f"every one of the {refused} event(s) sent so far was rejected by the "
                                      f"backend ({self._first_rejection}): nothing of this job reaches "
                                      f"TrainGuard -- check TRAINGUARD_PROJECT and the token")

    def _schedule_retry(self, exc: TransportError) -> None:
        opts = self._options
        self._backoff = min(opts.backoff_max, max(opts.backoff_initial, self._backoff * 2))
        self._retry_at = time.monotonic() + retry_delay(self._backoff, exc.retry_after)

    def _to_spool(self, events: List[Event]) -> None:
        spool = self._get_spool()
        try:
            evicted = spool.append(events)
        except SpoolError as exc:
            self._count(drops=[("spool_error", len(events))])
            warn_once("spool:write", f"spool write failed ({exc}); dropping events (counted)")
            return
        # the evicted (older) events were counted as spooled when they went in
        self._count(spooled=len(events) - evicted, drops=[("spool_full", evicted)])
        self._settle(events)
        if evicted:
            warn_once("spool:full", "spool is full; evicting the oldest batches (counted)")

    def _peek(self, spool: Spool) -> Optional[List[Event]]:
        """The spool's oldest batch; files that cannot be read back are dropped there, and counted here."""
        before = spool.discarded
        batch = spool.peek()
        lost = spool.discarded - before
        if lost:
            self._count(spooled=-lost, drops=[("spool_error", lost)])
            warn_once("spool:read", f"{lost} spooled event(s) could not be read back (counted)")
        return batch

    def _replay(self, spool: Optional[Spool], final: bool, max_batches: int = -1) -> bool:
        """Send ``spool``'s batches oldest first (at most ``max_batches``; -1: all); True unless a failure
        or the backoff stopped it."""
        while spool is not None and len(spool) > 0 and max_batches != 0:
            if self._in_backoff(final) or self._abandoned:
                return False
            batch = self._peek(spool)
            if batch is None:
                return True
            max_batches -= 1
            try:
                result = self._send(batch)
            except TransportError as exc:
                if exc.retryable:
                    if final or self._stopping:
                        self._final_failed = True
                    if exc.status not in _SHUTDOWN_STATUSES:
                        self.stats.retries += 1
                        self._schedule_retry(exc)
                    return False
                spool.pop()
                self._count(spooled=-len(batch), drops=[("rejected", len(batch))])
                warn_once(f"rejected:{exc.status}", f"backend rejected a spooled batch: {exc}")
                continue
            spool.pop()
            self._on_success(result, len(batch), replayed=True)
        return True
