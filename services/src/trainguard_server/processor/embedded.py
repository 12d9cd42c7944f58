"""The embedded processor runtime: queue → pure pipeline → stores, in a thread of ``trainguard serve``.

Exactly-once effect from at-least-once delivery:
1. records are consumed and their events run through the pipeline; raw context, metric points and the
   pipeline's upserts are written to the stores (all writes are idempotent);
2. every ``snapshot_every_s`` the pipeline state is saved *with the offsets it covers*, and only then are
   those records committed on the queue;
3. after a crash the last snapshot is restored and the queue redelivers everything after it; re-applying
   those records yields the same stores, and the pipeline's event-id memory keeps counts exact.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from trainguard import wire
from trainguard.core import extract
from trainguard.core.catalogue import DetectionSettings
from trainguard.core.pipeline import Pipeline, PipelineOutput
from trainguard.v1 import ingest_pb2

from ..queue.base import Queue, QueueRecord
from ..storage.base import EventsRejected, EventStore, IncidentStore, MetricPoint, MetricStore, StoredEvent

log = logging.getLogger("trainguard.processor")

STATE_KEY = "pipeline/embedded"
MIN_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
"""A round that failed (a store unavailable) is retried after a backoff doubling from MIN to MAX."""


@dataclass
class ProcessorStats:
    """Counters exposed on /metrics."""

    records: int = 0
    events: int = 0
    metric_points: int = 0
    undecodable: int = 0
    errors: int = 0
    snapshots: int = 0
    last_lag_s: float = 0.0
    rejected_events: int = 0   # raw-context events a store refused for good (a bad document), logged
    store_retries: int = 0     # rounds retried because a store was unavailable


class EmbeddedProcessor:
    """Consumes the queue on a thread; ``drain()`` processes everything queued and checkpoints."""

    def __init__(self, queue: Queue, events: EventStore, metrics: MetricStore, incidents: IncidentStore,
                 detection: Optional[DetectionSettings] = None, *, batch: int = 256,
                 snapshot_every_s: float = 5.0, tick_interval_s: float = 1.0,
                 yield_to: Optional[Callable[[], bool]] = None, max_yield_s: float = 0.05) -> None:
        self.queue = queue
        self.events = events
        self.metrics = metrics
        self.incidents = incidents
        self.detection = detection or DetectionSettings()
        self.batch = batch
        self.snapshot_every_s = snapshot_every_s
        self.tick_interval_s = tick_interval_s
        self.stats = ProcessorStats()
        #: ``yield_to()`` is True while ingest requests are in flight: between records the processor
        #: sleeps (releasing the GIL) for up to ``max_yield_s`` so acknowledgements are never starved —
        #: ingest is the latency clients feel, processing can lag a little.
        self.yield_to = yield_to
        self.max_yield_s = max_yield_s
        self.pipeline = self._restore()
        self._uncommitted: List[QueueRecord] = []
        #: records whose round failed (a store unavailable): processed again, before anything new, after
        #: a backoff -- never committed until they went through. The pipeline is idempotent under replay.
        self._retry: List[QueueRecord] = []
        self._retry_at = 0.0
        self._backoff_s = 0.0
        self._last_snapshot = time.monotonic()
        self._last_tick = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()  # one processing round at a time (thread vs drain())
        self.listeners: List[Any] = []  # callables(PipelineOutput) — live updates

    # --- state ----------------------------------------------------------------------------------
    def _restore(self) -> Pipeline:
        blob = self.incidents.load_state(STATE_KEY)
        if blob is None:
            return Pipeline(self.detection)
        try:
            return Pipeline.restore(blob, self.detection)
        except Exception as exc:  # an unreadable snapshot: start clean, the stores keep the history
            log.error("pipeline snapshot unreadable (%s); starting from an empty state", exc)
            return Pipeline(self.detection)

    def checkpoint(self) -> None:
        """Save the pipeline state, then commit the records it covers."""
        with self._lock:
            self._checkpoint_locked()

    def _checkpoint_locked(self) -> None:
        self.incidents.save_state(STATE_KEY, self.pipeline.snapshot())
        if self._uncommitted:
            self.queue.commit(self._uncommitted)
            self._uncommitted = []
        self.stats.snapshots += 1
        self._last_snapshot = time.monotonic()

    # --- processing -----------------------------------------------------------------------------
    def run_once(self, timeout: float) -> int:
        """One round: consume up to ``batch`` records (waiting up to ``timeout``), process, maybe
        checkpoint and run timers. Returns the number of records processed."""
        if self._retry:
            wait = self._retry_at - time.monotonic()
            if wait > 0:
                time.sleep(min(wait, timeout))
                return 0
            records, self._retry = self._retry, []
            self.stats.store_retries += 1
        else:
            records = self.queue.consume(self.batch, timeout)
        for i, record in enumerate(records):
            try:
                with self._lock:
                    self._process([record])
            except Exception:
                # a store is unavailable: keep this record and the rest for a retry after a backoff
                # (doubling to MAX_BACKOFF_S); nothing of them is committed meanwhile
                self._retry = list(records[i:])
                self._backoff_s = min(MAX_BACKOFF_S, max(MIN_BACKOFF_S, 2 * self._backoff_s))
                self._retry_at = time.monotonic() + self._backoff_s
                raise
            if i + 1 < len(records):
                self._yield_to_ingest()
        self._backoff_s = 0.0
        with self._lock:
            now = time.monotonic()
            due = self.pipeline.next_timer_ns
            if now - self._last_tick >= self.tick_interval_s or (due and time.time_ns() >= due):
                self._last_tick = now
                self._apply(self.pipeline.advance(time.time_ns()))
            if self._uncommitted and now - self._last_snapshot >= self.snapshot_every_s:
                self._checkpoint_locked()
        return len(records)

    def _yield_to_ingest(self) -> None:
        busy = self.yield_to
        if busy is None:
            return
        end = time.monotonic() + self.max_yield_s
        while busy() and time.monotonic() < end:
            time.sleep(0.0005)

    def _process(self, records: Sequence[QueueRecord]) -> None:
        envelopes: List[Dict[str, Any]] = []
        for record in records:
            try:
                request = ingest_pb2.IngestRequest.FromString(record.value)
                envelopes.extend(wire.envelope_to_dict(ev) for ev in request.events)
            except Exception as exc:  # the gateway validated it; a bad record is a bug, not data
                self.stats.undecodable += 1
                log.error("undecodable queue record %s/%s: %s", record.partition, record.offset, exc)
        self._store_raw(envelopes)
        self._run_pipeline(envelopes)
        now_ns = time.time_ns()
        if records:
            self.stats.last_lag_s = max(0.0, (now_ns - records[-1].published_ns) / 1e9)
        self.stats.records += len(records)
        self.stats.events += len(envelopes)
        self._uncommitted.extend(records)

    def _run_pipeline(self, envelopes: Sequence[Dict[str, Any]]) -> None:
        """The pipeline's part of a round (a runtime that runs it elsewhere overrides this)."""
        self._apply(self.pipeline.process(envelopes))

    def _store_raw(self, envelopes: Sequence[Dict[str, Any]]) -> None:
        points: List[MetricPoint] = []
        stored: List[StoredEvent] = []
        for env in envelopes:
            project = env.get("project", "")
            run_id = env.get("run_id", "")
            rank = int(env.get("rank", 0))
            time_ns = int(env.get("time_unix_nano", 0))
            for name, step, value in extract.metric_points(env):
                points.append(MetricPoint(project, run_id, rank, name, step, time_ns, value))
            if extract.is_raw_context(env):
                stored.append(StoredEvent(
                    event_id=env["event_id"], project=project, run_id=run_id, rank=rank,
                    host=env.get("host", ""), kind=_kind(env), severity=env.get("severity", "INFO"),
                    step=int(env.get("step", 0)), time_ns=time_ns, text=extract.raw_text(env),
                    payload=env))
        if points:
            self.metrics.put(points)
            self.stats.metric_points += len(points)
        if stored:
            try:
                self.events.put(stored)
            except EventsRejected as exc:  # the store wrote the rest of the batch
                if not exc.permanent:
                    raise  # unavailable for some of them: the round is retried
                self.stats.rejected_events += len(exc.rejected)  # refused for good: logged, not retried
                log.error("%s", exc)

    def _apply(self, output: PipelineOutput) -> None:
        if output.runs:
            self.incidents.upsert_runs(output.runs)
        if output.incidents:
            self.incidents.upsert_incidents(output.incidents)
        if output.clusters:
            self.incidents.upsert_clusters(output.clusters)
        if output.runs or output.incidents or output.clusters:
            for listener in list(self.listeners):
                try:
                    listener(output)
                except Exception:
                    log.exception("processor listener failed")

    # --- thread ---------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """True while the processing thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="trainguard-processor", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                due = self.pipeline.next_timer_ns  # wake up for the pipeline's next deadline (a stall)
                wait = 0.2 if not due else min(0.2, max(0.0, (due - time.time_ns()) / 1e9))
                self.run_once(timeout=wait)
            except Exception:
                self.stats.errors += 1
                log.exception("processing round failed; retrying")
                time.sleep(0.5)

    def stop(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop the thread; with ``drain``, process what is queued first. Always checkpoints."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if drain:
            self.drain(timeout)
        self.checkpoint()

    def drain(self, timeout: float = 30.0) -> None:
        """Process until the queue has nothing uncommitted left to hand out (or ``timeout``)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.run_once(timeout=0.0) == 0:
                break


def _kind(env: Dict[str, Any]) -> str:
    for kind in ("exception", "log", "lifecycle", "heartbeat", "memory", "metrics"):
        if kind in env:
            return kind
    return "unknown"

