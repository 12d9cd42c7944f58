"""The embedded processor runtime: queue → pure pipeline → stores, in a thread of ``trainguard serve``.

Exactly-once effect from at-least-once delivery:
1. records are consumed and their events run through the pipeline; raw context, metric points and the
   pipeline's upserts are written to the stores (all writes are idempotent; the metric points of a few
   chunks in one transaction, written before anything relies on them: :data:`METRIC_WRITE_CHUNKS`);
2. every ``snapshot_every_s`` the pipeline state is saved *with the offsets it covers* (per partition and
   lane, the highest offset whose record went through the pipeline: :data:`OFFSETS_PREFIX`), every store is
   synced (``sync()``: the SQLite stores' per-round commits are made durable here, not each round --
   storage/sqlite.py's Durability), and only then are those records committed on the queue; the save is
   incremental -- the runs and clusters that changed since the last one, in one transaction
   (``Pipeline.changed_parts``, keys under ``PARTS_PREFIX``);
3. after a crash the last snapshot is restored and the queue redelivers everything after its last
   commit -- records the snapshot already covers too, when the crash came between a snapshot's save and
   its queue commit: those are written to the stores again (idempotent; a store's deferred writes lost with
   a power loss are redone) but not handed to the pipeline again, so its state and counters are exactly
   those of an uninterrupted run; re-applying the records after them yields the same stores.
"""

from __future__ import annotations

import gc
import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Callable, Deque, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

from trainguard_engine import extract
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.pipeline import Pipeline, PipelineOutput, ReadEnvelope, merge_outputs

from ..gateway.backlog import dict_weight
from ..queue.base import Queue, QueueRecord
from ..queue.common import PARTITION
from ..storage.base import EventsRejected, EventStore, IncidentStore, MetricColumns, MetricStore, StoredEvent
from . import decode
from .decode import Envelope, PlainBatch, Points, read_request
from .left_out import HOLD_S, LeftOutRuns, RunId, project_of
from .pool import ISOLATE_AFTER, JobRecord, PipelinePool, PoolFailed, RemotePipeline, Started
from .rank_parts import RankParts
from .repartition import split_single_state

log = logging.getLogger("trainguard.processor")

STATE_KEY = "pipeline/embedded"
"""Where a processor before incremental snapshots kept its whole state (read once, then deleted)."""
PARTS_PREFIX = "pipeline/embedded/"
"""The pipeline's snapshot parts (``Pipeline.changed_parts``) are state keys under this prefix (a queue with
one partition: SQLite, memory)."""
OFFSETS_PREFIX = "pipeline/offsets/"
"""What a pipeline snapshot covers is saved with it, in the same transaction, under this prefix (``embedded``
over a queue with one partition, ``partition/<partition>`` over a partitioned one: outside the parts'
prefixes): JSON ``{"lanes": <the queue's lane count>, "queue": <its identity>, "tops": [[lane, offset],
...]}``, the highest offset per lane whose record went through that pipeline since the last queue commit (a
committed record is never delivered again, so the tops start empty after each commit). The queue computes
lanes from the keys when it reads (``queue_lanes`` may change between starts), so a cover saved under
another lane count is ignored, as is one saved for another queue (``Queue.identity``, when both are known: a
queue file moved aside or restored from a backup numbers its records anew -- hR's F1 of stop 46; a cover
without it is read as before), a snapshot saved before this existed (none) or in the list-only form of its
first version: their restore hands every redelivered record to the pipeline, as before (counters may count
a replay twice; no record is skipped)."""
PARTITION_PREFIX = "pipeline/partition/"
"""Over a partitioned queue (Kafka) each partition's pipeline has its parts under ``<this><partition>/``:
a processor restores the partitions it is assigned, saves and commits those it gives up."""
MIN_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
"""A round that failed (a store unavailable) is retried after a backoff doubling from MIN to MAX."""
DEFAULT_ROUND_EVENTS = 8192
"""Envelopes per pipeline call and store write at most: big enough that per-call costs vanish (ingest is
yielded to after every this many envelopes of continuous processing)."""
DEFAULT_ROUND_TARGET_S = 0.1
"""How long one chunk (one pipeline call and one write per store) should take (``TRAINGUARD_PROCESSOR_ROUND_
TARGET_S``; 0: no time bound, chunks of ``round_events``): the processor measures its recent envelopes per
second (wall clock: what the gateway's load leaves it) and takes only as many records as it can process in
about this long, so a record published now -- a quiet run's alert, handed out by the fair queue at its
next consume -- waits for at most about one such chunk, not ~2-3 s of an 8,192-envelope one. The queue
is consumed once per such round too, so its round-robin over runs turns that often. Measured
(bench/results/latency_issue15_stop39.txt, 500-envelope background at half the gRPC rate, the processor
past capacity): event -> incident p99 ~0.45 s at 0.1, ~0.76 s at 0.15, ~0.91-0.94 s at 0.25, unbounded at 0
(32 of 120 probes lost); processor-alone throughput at 0.1 within this loaded machine's noise of 0
(bench/round_bound.py)."""
MIN_ROUND_EVENTS = 256
"""The time bound never cuts a chunk below this many envelopes (a record is never split: one bigger is a
chunk of its own), so the per-chunk costs stay small beside the chunk's work whatever a slow chunk
measured."""
RATE_WEIGHT = 0.5
"""Weight of the last chunk in the processor's running estimate of envelopes per second (an exponential
moving average: a slow chunk halves the next round at once, one outlier is half-forgotten by the next)."""
LAG_WINDOW_S = 1.0
"""The processing lag reported (``ProcessorStats.last_lag_s``, /metrics) is the largest of the chunks of the
last this many seconds: with fair consumption one chunk may hold only a quiet run's fresh record while a
noisy run's records wait, so the last chunk alone says little."""
METRIC_WRITE_CHUNKS = 1
"""Metric write-behind, OFF by default (1): with more, the metric points of this many chunks are written to
the metric store in ONE transaction (``MetricStore.put_columns_many``: each chunk's own writes, so the same
series ids and rows as one write per chunk), not one transaction per chunk (1 or less: one per chunk).
Measured (bench/results/processor_store_issue15_stop43.txt, SQLite, 96 series, 4096-byte pages): at ~90
points a series a chunk 1.05-1.09 us/point one chunk a transaction, 0.89-0.92 four; at 20 points 1.8 ->
1.1 (five). Held points are written before anything that reads or relies on them: before a pipeline output
with incidents is applied (an incident is never in the store before its points), before every checkpoint's
store sync (so before any queue commit: the durability argument of storage/sqlite.py is unchanged), on
stop (its checkpoint), when a round finds nothing to process (caught up) and after
:data:`METRIC_WRITE_DELAY_S` -- so a run's live metrics reach the query API (another thread) at most about
that much later than without it. A failed write keeps them held (written again by the next write; the
chunk whose write failed is retried with its round, as before). Why off by default: a run's record is
upserted when its chunk's output is applied, so with points held a client could list a run -- or see its
events -- and read no metrics for it for up to the delay (the fresh-clone CI caught two end-to-end tests doing
exactly that, stop 43), for a gain of ~0.35 us/event (sdk16's metric writes) that the whole-drain bench cannot
resolve. An operator who wants fewer transactions turns it on (TRAINGUARD_PROCESSOR_METRIC_WRITE_CHUNKS)."""
METRIC_WRITE_DELAY_S = 0.5
"""The longest metric points are held by the write-behind (:data:`METRIC_WRITE_CHUNKS`): checked after each
chunk and after each round (0: every chunk writes its own, as with one chunk)."""
UNCOMMITTED_MAX_BYTES = 256 * 1024 * 1024
"""The most record bytes the processor holds taken and not committed (until the next checkpoint; with
pipeline workers the pool keeps the same records to rebuild a dead worker, processor/pool.py) before it
checkpoints ahead of time -- and, while that checkpoint fails, takes no more records
(TRAINGUARD_PROCESSOR_UNCOMMITTED_MAX_MB). At snapshot_every_s 5 and ~40k events/s of ~150-byte envelopes
it holds ~30 MB between checkpoints."""
RECORD_WINDOW = 16
"""Chunks over which the processor remembers the largest record (envelopes): a round takes as many records
as fit its time bound *at that size*, so one-envelope alerts handed out between a noisy run's 500-envelope
records do not make it take several of the latter at once."""


GC_GEN0_THRESHOLD = 50_000
"""Allocations between two young-generation collections in a process that runs a processor (Python's
default, 700, makes the collector walk the pipeline's long-lived state over and over while a chunk
allocates its short-lived dicts and tuples: 8-15 % of a round's CPU, bench/processor.py).

The processor's garbage-collection policy is this threshold (process-wide: :func:`tune_gc`) together with
the collector paused during each round (``EmbeddedProcessor(pause_gc=True)``, the default; see
``EmbeddedProcessor._round``). Measured on full drains, time inside collections (``gc.callbacks``), 2 runs
(bench/results/processor_store_issue15_stop43.txt): a 134,432-event SDK-shaped drain spends 5.3-5.4
us/event in collections under Python's defaults (~1,600 young, ~145 middle, 13 full ones), 1.4-1.5 with the
pause alone, 0.09-0.13 with the threshold alone and 0.04-0.06 with both (one young, one middle); the
500-envelope drain (60,000 events) 3.1-4.1, 0.00, 0.87-1.07 and 0.00. Peak RSS over the drain is the same
under every policy (117-125 MB, within one policy's spread): no cyclic garbage builds up, the pipeline's
garbage is freed by reference counting. Both are overridable: ``tune_gc(threshold)`` (0: the
interpreter's kept) and ``pause_gc=False`` -- in ``trainguard serve`` the settings
``TRAINGUARD_PROCESSOR_GC_GEN0_THRESHOLD`` and ``TRAINGUARD_PROCESSOR_GC_PAUSE`` (config.py)."""


def tune_gc(threshold: int = GC_GEN0_THRESHOLD) -> None:
    """Collect the young generation every ``threshold`` allocations (default :data:`GC_GEN0_THRESHOLD`),
    not 700 (process-wide: call from a process's entry point, as ``trainguard serve`` does); a threshold
    at or below the interpreter's current one (0 included) keeps that one. Garbage is still collected;
    memory held by short-lived cycles grows by at most that many objects."""
    gen0, gen1, gen2 = gc.get_threshold()
    if threshold > gen0:
        gc.set_threshold(threshold, gen1, gen2)


class PooledChunk(NamedTuple):
    """A chunk's jobs for the worker pool -- per partition, ``(run key, record)`` pairs -- and their call,
    started (None: to run one run at a time)."""

    jobs: List[Tuple[int, List[Tuple[RunId, JobRecord]]]]
    started: Optional[Started]


class _Chunk(NamedTuple):
    """Queue records and their envelopes, decoded once, with each envelope's metric points and partition,
    and each record's count of envelopes."""

    records: List[QueueRecord]
    envelopes: List[Envelope]
    points: List[Points]
    partitions: List[int]
    sizes: List[int]


UNWRITABLE = (ValueError, TypeError, OverflowError)
"""What a store's write raises for a record it can never take (a value outside its types), as opposed to
being unavailable (sqlite3/psycopg/HTTP errors): that record is dropped, not retried (_apply_apart)."""


@dataclass
class ProcessorStats:
    """Counters exposed on /metrics."""

    records: int = 0
    events: int = 0
    metric_points: int = 0
    undecodable: int = 0
    errors: int = 0
    snapshots: int = 0
    last_lag_s: float = 0.0    # publish-to-processed time of the oldest record of the last LAG_WINDOW_S
    rejected_events: int = 0   # raw-context events a store refused for good (a bad document), logged
    store_retries: int = 0     # rounds retried because a store was unavailable
    rounds: int = 0            # chunks processed: one pipeline call and one write per store each
    early_checkpoints: int = 0  # checkpoints tried before a round: uncommitted records over their bound
    rejected_records: int = 0  # run/incident/cluster records the incident store refused for good, logged


class EmbeddedProcessor:
    """Consumes the queue on a thread; ``drain()`` processes everything queued and checkpoints."""

    per_partition_state = True
    """Over a partitioned queue, one pipeline per owned partition (False: a subclass keeps no state)."""

    def __init__(self, queue: Queue, events: EventStore, metrics: MetricStore, incidents: IncidentStore,
                 detection: Optional[DetectionSettings] = None, *, batch: int = 256,
                 round_events: int = DEFAULT_ROUND_EVENTS, round_target_s: float = DEFAULT_ROUND_TARGET_S,
                 snapshot_every_s: float = 5.0, tick_interval_s: float = 1.0,
                 yield_to: Optional[Callable[[], bool]] = None, max_yield_s: float = 0.05,
                 quota_log_interval_s: float = 60.0,
                 processed: Optional[Callable[[Mapping[str, int]], None]] = None,
                 pause_gc: bool = True, metric_write_chunks: int = METRIC_WRITE_CHUNKS,
                 metric_write_delay_s: float = METRIC_WRITE_DELAY_S, processor_workers: int = 0,
                 pool_isolate_after: int = ISOLATE_AFTER, pool_left_out_s: float = HOLD_S,
                 pool_call_timeout_s: float = 0.0,
                 uncommitted_max_bytes: int = UNCOMMITTED_MAX_BYTES) -> None:
        self.queue = queue
        self.events = events
        self.metrics = metrics
        self.incidents = incidents
        self.detection = detection or DetectionSettings()
        self.batch = batch
        self.round_events = max(1, round_events)
        self.round_target_s = max(0.0, round_target_s)
        #: running estimates for the round's time bound (0: none yet): envelopes per second of wall clock
        #: through a chunk (its decode and _process), and the largest record's envelopes of each of the
        #: last RECORD_WINDOW chunks
        self.rate_events_per_s = 0.0
        self.record_sizes: Deque[int] = deque(maxlen=RECORD_WINDOW)
        self._since_yield = 0  # envelopes processed since the processor last yielded to ingest
        self._lags: Deque[Tuple[int, float]] = deque()  # (when, lag of the chunk's oldest record)
        self.snapshot_every_s = snapshot_every_s
        self.tick_interval_s = tick_interval_s
        self.stats = ProcessorStats()
        #: ``yield_to()`` is True while ingest requests are in flight: between records the processor
        #: sleeps (releasing the GIL) for up to ``max_yield_s`` so acknowledgements are never starved —
        #: ingest is the latency clients feel, processing can lag a little.
        self.yield_to = yield_to
        self.max_yield_s = max_yield_s
        #: ``processed(counts)`` after each chunk went through the stores and the pipeline (the gateway's
        #: per-project backlog count, gateway/backlog.py): the chunk's events per project, weighed as the
        #: backlog admitted them (:func:`backlog_counts`); it must not raise
        self.processed = processed
        #: the cyclic garbage collector rests while a round's records are processed (:meth:`run_once`;
        #: the policy and its figures: :data:`GC_GEN0_THRESHOLD`); False: the collector runs as it is set
        self.pause_gc = pause_gc
        #: the metric write-behind (:data:`METRIC_WRITE_CHUNKS`): chunks' metric columns not yet written,
        #: oldest first, and since when the oldest is held (time.monotonic())
        self.metric_write_chunks = max(1, int(metric_write_chunks))
        self.metric_write_delay_s = max(0.0, float(metric_write_delay_s))
        self._held_metrics: List[MetricColumns] = []
        self._held_since = 0.0
        #: one pipeline per partition this processor owns (a queue with one partition: just partition 0)
        self.partitioned = self.per_partition_state and bool(getattr(queue, "partitioned", False))
        #: over a partitioned queue with ``processor_workers`` (> 0), the pipelines run in that many worker
        #: processes (processor/pool.py) and ``pipelines`` holds their stand-ins; 0: in this thread
        self.pool: Optional[PipelinePool] = None
        if self.partitioned and processor_workers > 0:
            self.pool = PipelinePool(processor_workers, self.detection, self._stored_parts, pause_gc=pause_gc,
                                     gc_threshold=gc.get_threshold()[0], call_timeout_s=pool_call_timeout_s)
        self.pipelines: Dict[int, Union[Pipeline, RemotePipeline]] = {}
        #: pool chunks failed in a row, and after how many the next runs one run at a time; the runs whose
        #: records ended their worker then, by (project, run id): their records are stored, not detected
        #: on, until a checkpoint ``pool_left_out_s`` later (processor/left_out.py)
        self._pool_failures = 0
        #: the records taken and not yet committed (held until the next checkpoint; with a worker pool also
        #: kept to rebuild a dead worker) may hold this many bytes; over it a checkpoint comes first, and
        #: while that fails no record is taken (:meth:`run_once`)
        self.uncommitted_max_bytes = max(1, int(uncommitted_max_bytes))
        self._uncommitted_bytes = 0
        self.pool_isolate_after = max(1, pool_isolate_after)
        self.poisoned_runs = LeftOutRuns(pool_left_out_s)
        #: per partition, per lane: the highest offset whose record went through that partition's pipeline
        #: (saved with its snapshot: OFFSETS_PREFIX), and of those restored, the lanes whose redelivered
        #: records at or below it the pipeline already has (emptied as the lanes pass them)
        self._tops: Dict[int, Dict[int, int]] = {}
        self._covered: Dict[int, Dict[int, int]] = {}
        #: each pipeline's big runs stored below the run, in rank parts (only the changed ones rewritten)
        self._rank_parts: Dict[int, RankParts] = {}
        self._legacy_state = False
        if not self.partitioned:
            if self.per_partition_state and incidents.state_keys(PARTITION_PREFIX):  # hR2's G5
                log.warning("per-partition pipeline snapshots (%r) are in the store, but this queue has "
                            "one partition: they are not restored here (runs in flight start from the "
                            "one-partition state, else empty), and a queue partitioned again later would "
                            "restore them, older", PARTITION_PREFIX)
            self.pipelines[PARTITION] = self._restore(PARTITION)
        elif not getattr(queue, "revokes_partitions", True) and not incidents.state_keys(PARTITION_PREFIX):
            # an embedded queue turned partitioned: the one state is handed to the partitions, each run to
            # its own (processor/repartition.py; Kafka places keys by its own hash: not there)
            split_single_state(incidents, self.detection, lanes=queue.lanes,
                               partitions=int(getattr(queue, "partitions", 1)), single_prefix=PARTS_PREFIX,
                               whole_key=STATE_KEY, single_offsets=self._offsets_key(PARTITION, single=True),
                               prefix_of=self._prefix, offsets_of=self._offsets_key)
        elif incidents.state_keys(PARTS_PREFIX) or incidents.load_state(STATE_KEY) is not None:
            log.warning("a one-partition pipeline snapshot (%r) is in the store: it is not restored "
                        "over this partitioned queue (per-partition state exists already, or the queue "
                        "places runs by a hash of its own: Kafka); detection state rebuilds from new "
                        "events", PARTS_PREFIX)
        self._report_quarantined()
        self._uncommitted: List[QueueRecord] = []
        #: records whose round failed (a store unavailable): processed again, before anything new, after
        #: a backoff -- never committed until they went through. The pipeline is idempotent under replay.
        self._retry: List[QueueRecord] = []
        self._retry_at = 0.0
        #: pipeline outputs not yet in the stores (their upsert failed), by partition: applied first
        self._pending: Dict[int, PipelineOutput] = {}
        self._through = False  # the chunk in hand went through its pipeline(s) (:meth:`_process`)
        self._backoff_s = 0.0
        self._last_snapshot = time.monotonic()
        self._last_tick = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()  # one processing round at a time (thread vs drain())
        self.listeners: List[Any] = []  # callables(PipelineOutput) — live updates
        self.quota_log_interval_s = quota_log_interval_s
        #: what /readyz reports (api/routes/health.py): the last checkpoint's error ("" once one succeeds)
        #: and how many failed in a row; the last processing round's error ("" once a round completes)
        self.last_checkpoint_error = ""
        self.checkpoint_failures = 0
        self.last_round_error = ""
        self._quota_logged: Dict[Tuple[str, str], Tuple[int, float]] = {}  # (project, quota) -> (count, when)
        if self.partitioned:
            queue.set_rebalance_listener(self)

    @property
    def pipeline(self) -> Pipeline:
        """The pipeline of a queue with one partition (a partitioned queue's are in :attr:`pipelines`)."""
        if self.partitioned:
            raise AttributeError("a processor over a partitioned queue has one pipeline per partition "
                                 "(.pipelines)")
        return self._local(PARTITION)

    def _local(self, partition: int) -> Pipeline:
        """``partition``'s pipeline, run in this thread (no worker pool)."""
        pipeline = self.pipelines[partition]
        assert isinstance(pipeline, Pipeline), "the pipelines run in worker processes"
        return pipeline

    @property
    def counters(self) -> Dict[str, int]:
        """The pipelines' counters, summed (for /metrics)."""
        out: Dict[str, int] = {}
        for pipeline in list(self.pipelines.values()):
            for name, value in pipeline.counters.items():
                out[name] = out.get(name, 0) + value
        return out

    @property
    def quota_evictions(self) -> Dict[Tuple[str, str], int]:
        """Evictions per (project, quota), summed over the pipelines (for /metrics)."""
        out: Dict[Tuple[str, str], int] = {}
        for pipeline in list(self.pipelines.values()):
            for key, value in pipeline.quota_evictions.items():
                out[key] = out.get(key, 0) + value
        return out

    # --- state ----------------------------------------------------------------------------------
    def _prefix(self, partition: int) -> str:
        """Where ``partition``'s pipeline keeps its snapshot parts."""
        return f"{PARTITION_PREFIX}{partition}/" if self.partitioned else PARTS_PREFIX

    def _offsets_key(self, partition: int, single: bool = False) -> str:
        """Where ``partition``'s pipeline keeps the offsets its snapshot covers (:data:`OFFSETS_PREFIX`;
        ``single``: where a one-partition processor does)."""
        if self.partitioned and not single:
            return f"{OFFSETS_PREFIX}partition/{partition}"
        return f"{OFFSETS_PREFIX}embedded"

    def _cover(self, tops: List[Tuple[int, int]]) -> Dict[str, Any]:
        """What :data:`OFFSETS_PREFIX` keeps for ``tops``: the lane count, the queue's identity (when it has
        one: ``Queue.identity``) and the tops."""
        identity = str(getattr(self.queue, "identity", "") or "")
        return ({"lanes": self.queue.lanes, "queue": identity, "tops": tops} if identity
                else {"lanes": self.queue.lanes, "tops": tops})

    def _load_offsets(self, partition: int) -> None:
        """The offsets ``partition``'s restored snapshot covers (none saved: nothing is skipped)."""
        blob = self.incidents.load_state(self._offsets_key(partition))
        if blob is None:
            return
        try:
            saved = json.loads(blob)
            if not isinstance(saved, dict):  # the list-only form (no lane count): lanes unknown
                return
            tops = {int(lane): int(offset) for lane, offset in saved["tops"]}
            lanes = int(saved["lanes"])
            written_for = str(saved.get("queue", ""))
        except (ValueError, TypeError, KeyError) as exc:  # unreadable: every redelivered one to the pipeline
            log.error("the offsets of the pipeline snapshot are unreadable (%s); redelivered records go "
                      "through the pipeline again", exc)
            return
        if lanes != self.queue.lanes:  # lanes are computed when read: another count numbers them otherwise
            log.info("the pipeline snapshot's offsets were saved over %d queue lanes, the queue has %d now; "
                     "redelivered records go through the pipeline again", lanes, self.queue.lanes)
            return
        identity = str(getattr(self.queue, "identity", "") or "")
        if written_for and identity and written_for != identity:  # another queue file: its offsets mean
            # other records (a file moved aside or restored numbers its records anew; hR F1)
            log.warning("the pipeline snapshot's offsets were saved for another queue (%s, this one is %s); "
                        "redelivered records go through the pipeline again", written_for, identity)
            return
        self._tops[partition] = dict(tops)
        self._covered[partition] = tops

    def _stored_parts(self, partition: int) -> Dict[str, Optional[bytes]]:
        """``partition``'s snapshot parts as stored (names without the prefix; split by rank_parts)."""
        prefix = self._prefix(partition)
        keys = self.incidents.state_keys(prefix)
        return {key[len(prefix):]: self.incidents.load_state(key) for key in keys}

    def _restore(self, partition: int) -> Union[Pipeline, RemotePipeline]:
        """``partition``'s pipeline as last saved (empty when nothing was); with a worker pool, hosted by
        its worker (which joins the rank parts and restores it)."""
        parts = self._stored_parts(partition)
        blob = None if parts or self.partitioned else self.incidents.load_state(STATE_KEY)
        self._tops.pop(partition, None)
        self._covered.pop(partition, None)
        if self.pool is not None:
            if parts:
                self._load_offsets(partition)
            return self.pool.build(partition, {k: v for k, v in parts.items() if v is not None})
        splitter = self._rank_parts[partition] = RankParts()
        try:
            if parts:
                self._load_offsets(partition)
                return Pipeline.restore_parts(splitter.from_store({k: v for k, v in parts.items()
                                                                   if v is not None}), self.detection)
            if blob is None:
                return Pipeline(self.detection)
            self._legacy_state = True  # the first checkpoint writes it as parts and deletes it
            return Pipeline.restore(blob, self.detection)
        except Exception as exc:  # an unreadable snapshot: start clean, the stores keep the history
            log.error("pipeline snapshot unreadable (%s); starting from an empty state", exc)
            return Pipeline(self.detection)

    def checkpoint(self) -> None:
        """Save the pipeline state, then commit the records it covers."""
        with self._lock:
            self._checkpoint_locked()

    def _checkpoint_locked(self) -> None:
        try:
            self._save_and_commit()
        except Exception as exc:
            self.checkpoint_failures += 1
            self.last_checkpoint_error = _describe(exc)
            raise
        self.checkpoint_failures = 0
        self.last_checkpoint_error = ""
        if self.poisoned_runs:
            self.poisoned_runs.expire()

    def _save_and_commit(self) -> None:
        self._save_parts(list(self.pipelines))
        if self._uncommitted:
            self._commit_held()
            # every record through a pipeline so far is committed (never delivered again): the next
            # snapshot covers only what comes after (OFFSETS_PREFIX), not every lane ever used
            self._tops.clear()
        self.stats.snapshots += 1
        self._last_snapshot = time.monotonic()

    def _commit_held(self) -> None:
        """Commit every record taken so far, after the stores' writes are durable (:meth:`_sync_stores`)."""
        self._sync_stores()
        self.queue.commit(self._uncommitted)
        self._uncommitted = []
        self._uncommitted_bytes = 0

    @property
    def uncommitted_bytes(self) -> int:
        """The record bytes taken and not committed yet (bounded by :attr:`uncommitted_max_bytes`)."""
        return self._uncommitted_bytes

    def _sync_stores(self) -> None:
        """Every store's writes so far durable (``sync()``): called before any queue commit, so no offset is
        committed before the writes of the records it covers -- their raw context, points, records and
        the snapshot -- are on disk (a power loss included: storage/sqlite.py's Durability); the metric
        points the write-behind holds are written first (:data:`METRIC_WRITE_CHUNKS`)."""
        self._write_held_metrics()
        for store in (self.events, self.metrics, self.incidents):
            store.sync()

    def _save_parts(self, partitions: Sequence[int]) -> None:
        """Save what changed in ``partitions``' pipelines since their last save, in one transaction
        (``Pipeline.changed_parts``), after every pending output reached the stores (the snapshot says
        those records were emitted)."""
        self._apply_pending()
        items: Dict[str, Optional[bytes]] = {}
        chosen = [p for p in partitions if p in self.pipelines]
        if self.pool is not None:  # asked of every worker at once
            changed = self.pool.changed(chosen)
        else:
            changed = [self._rank_parts.setdefault(p, RankParts()).to_store(self._local(p).changed_parts())
                       for p in chosen]
        for partition, parts in zip(chosen, changed):
            prefix = self._prefix(partition)
            items.update((prefix + name, blob) for name, blob in parts.items())
            tops = self._tops.get(partition)
            if tops:
                items[self._offsets_key(partition)] = json.dumps(
                    self._cover(sorted(tops.items()))).encode()
        if self._legacy_state:
            items[STATE_KEY] = None
        self._report_quarantined()  # a run whose state could not be serialised was left out: say which
        self.incidents.save_states(items)
        if self.pool is not None:
            self.pool.saved(chosen)
        for partition in chosen if self.pool is None else ():
            self._local(partition).parts_saved()
            self._rank_parts[partition].saved()
        self._legacy_state = False

    # --- partitions (a consumer group rebalanced: see queue.base.RebalanceListener) ---------------
    def partitions_assigned(self, partitions: Sequence[int]) -> None:
        """Restore the pipelines of partitions this processor now owns."""
        with self._lock:
            for partition in partitions:
                if partition not in self.pipelines:
                    self.pipelines[partition] = self._restore(partition)
            self._report_quarantined()

    def partitions_revoked(self, partitions: Sequence[int], lost: bool) -> None:
        """Give up ``partitions``: save their pipelines and commit the records they cover (revoked), then
        drop them; ``lost`` ones are dropped only (their next owner re-reads what was not committed, and
        the pipeline is idempotent under that replay). Records of theirs waiting for a retry are dropped
        too: they are the next owner's."""
        gone = set(partitions)
        with self._lock:
            mine = [r for r in self._uncommitted if r.partition in gone]
            self._uncommitted = [r for r in self._uncommitted if r.partition not in gone]
            self._uncommitted_bytes = sum(len(r.value) for r in self._uncommitted)
            self._retry = [r for r in self._retry if r.partition not in gone]
            if not lost:
                try:
                    self._save_parts(sorted(gone))
                    if mine:
                        self._sync_stores()
                        self.queue.commit(mine)
                except Exception as exc:  # the next owner starts from the last checkpoint instead
                    log.warning("could not checkpoint revoked partitions %s (%s): their next owner "
                                "re-processes them from the last commit", sorted(gone), _describe(exc))
            if self.pool is not None:
                try:
                    self.pool.drop(sorted(gone))
                except PoolFailed as exc:  # the pool rebuilds only the partitions it still hosts
                    log.warning("%s", exc)
            for partition in gone:
                self.pipelines.pop(partition, None)
                self._rank_parts.pop(partition, None)
                self._pending.pop(partition, None)
                self._tops.pop(partition, None)
                self._covered.pop(partition, None)

    def _next_timer_ns(self) -> int:
        """The earliest ``next_timer_ns`` of the pipelines (0: none)."""
        due = [p.next_timer_ns for p in list(self.pipelines.values()) if p.next_timer_ns]
        return min(due) if due else 0

    def _pipeline_for(self, partition: int) -> Union[Pipeline, RemotePipeline]:
        """``partition``'s pipeline (restored on first use: a record can only come from an owned one)."""
        pipeline = self.pipelines.get(partition)
        if pipeline is None:
            pipeline = self.pipelines[partition] = self._restore(partition)
        return pipeline

    # --- processing -----------------------------------------------------------------------------
    def run_once(self, timeout: float) -> int:
        """One consumer round: take ``batch`` records -- fewer under the time bound, about as many as the
        recent rate processes in ``round_target_s`` (:meth:`_round_cap`) -- waiting up to ``timeout``
        (more while they are small: :meth:`_round`), then process them in chunks of at most that many
        envelopes (``round_events`` without the bound) -- per chunk one decode, one write per store and one
        pipeline call -- maybe checkpoint and run timers. Returns the records processed.

        A chunk whose store write fails is retried (it and every later record of the round) after a
        backoff; a pipeline output whose upsert failed is kept and applied before anything new."""
        if self._pending or self._retry:
            if self._backing_off(timeout):
                return 0
            self.stats.store_retries += 1
            try:
                with self._lock:
                    self._apply_pending()
            except Exception:
                self._back_off()
                raise
        fresh = not self._retry
        if fresh and self._uncommitted_bytes > self.uncommitted_max_bytes:
            # the records held since the last checkpoint (and, with workers, kept to rebuild one) are over
            # their bound -- checkpoints failing, or far apart: checkpoint before taking more; while that
            # fails (it raises, after backing off) nothing new is taken: the queue keeps the records and the
            # gateway's backlog bound pushes back, instead of this process's memory growing (G7)
            if self._backing_off(timeout):
                return 0
            self.stats.early_checkpoints += 1
            with self._lock:
                try:
                    self._checkpoint_locked()
                except Exception:
                    self._back_off()
                    raise
        if fresh:
            records = self.queue.consume(self._take_count(self._round_cap()), timeout)
        else:
            records, self._retry = self._retry, []
        paused = self.pause_gc and bool(records) and gc.isenabled()
        if paused:  # the collector rests while the round's records are processed (see _round)
            gc.disable()
        try:
            done = self._round(records, fresh)
        finally:
            if paused:
                gc.enable()
        self._backoff_s = 0.0
        self.last_round_error = ""
        with self._lock:
            now = time.monotonic()
            due = self._next_timer_ns()
            if now - self._last_tick >= self.tick_interval_s or (due and time.time_ns() >= due):
                self._last_tick = now
                now_ns = time.time_ns()
                owned = list(self.pipelines)
                advanced = (self.pool.advance(owned, now_ns) if self.pool is not None
                            else [self._local(p).advance(now_ns) for p in owned])
                for partition, output in zip(owned, advanced):
                    self._emit_later(partition, output)
                self._apply_pending()
                self._report_quarantined()
                self._report_quotas()
            if self._held_metrics and (not done or now - self._held_since >= self.metric_write_delay_s):
                self._write_held_metrics()  # caught up, or held long enough: the query API sees them
            if self._uncommitted and now - self._last_snapshot >= self.snapshot_every_s:
                self._checkpoint_locked()
        return done

    def _backing_off(self, timeout: float) -> bool:
        """True (after sleeping up to ``timeout``) while the backoff of a failed retry still runs."""
        wait = self._retry_at - time.monotonic()
        if wait > 0:
            time.sleep(min(wait, timeout))
            return True
        return False

    def _back_off(self) -> None:
        self._backoff_s = min(MAX_BACKOFF_S, max(MIN_BACKOFF_S, 2 * self._backoff_s))
        self._retry_at = time.monotonic() + self._backoff_s

    def _round(self, records: List[QueueRecord], fresh: bool) -> int:
        """Process ``records`` chunk by chunk -- each chunk decoded just before it runs, so a round holds at
        most about one chunk's decoded envelopes at once whatever records it took -- and, ``fresh`` from a
        queue with one partition or static ones, take more while the queue hands out all that was asked
        and the round has decoded fewer envelopes than a chunk holds (small records, e.g. the SDK's request
        per rank and step, then share one pipeline call and one write per store instead of one per
        consume: the per-round costs, commits included, are paid per chunk). A queue whose partitions may
        be revoked (Kafka; ``revokes_partitions``, True unless the queue says otherwise) is consumed once
        per round (a rebalance inside a later consume could revoke partitions whose records the round
        holds); the embedded queues' static partitions never are. Returns the records processed.

        A chunk is at most ``round_events`` envelopes, and under the time bound at most what the recent
        rate processes in ``round_target_s`` (:meth:`_round_cap`; a record is never split; one larger than
        that is a chunk of its own). After every ``round_events`` envelopes of processing the processor
        yields to ingest requests in flight (up to ``max_yield_s``). Runs with the cyclic garbage
        collector paused (run_once; ``pause_gc=False``: not): a round's decoded envelopes live until
        their chunk is through, so young-generation collections would walk tens of thousands of objects
        that all survive (4-6 % of a round's CPU, bench/processor.py); they are freed by reference
        counting. Waiting for records
        (consume's timeout) and the timers and checkpoints after a round run with the collector as it
        was."""
        more = fresh and not (self.partitioned and getattr(self.queue, "revokes_partitions", True))
        cap = self._round_cap()
        asked = self._take_count(cap)
        full = len(records) >= asked
        todo, at = records, 0   # records taken and not yet decoded: todo[at:]
        carry: Optional[Tuple[QueueRecord, List[Envelope], List[Points]]] = None  # did not fit
        decoded_envelopes = 0
        done = 0
        while True:
            chunk = _Chunk([], [], [], [], [])
            replayed: Optional[List[bool]] = None  # per envelope: its record the pipeline has (restored)
            chunk_started = time.perf_counter()
            largest = 0
            while True:
                if carry is not None:
                    record, decoded, decoded_points = carry
                    carry = None
                else:
                    if at == len(todo):
                        if not (more and full and cap - decoded_envelopes >= self._record_room()):
                            break
                        asked = self._take_count(cap - decoded_envelopes)
                        todo, at = self._take_more(asked), 0
                        full = len(todo) >= asked
                        more = more and bool(todo)
                        if not todo:
                            break
                    record = todo[at]
                    at += 1
                    decoded, decoded_points = self._decode(record)
                    decoded_envelopes += len(decoded)
                size = len(decoded)
                if chunk.records and len(chunk.envelopes) + size > cap:
                    carry = (record, decoded, decoded_points)
                    break
                chunk.records.append(record)
                if size > largest:
                    largest = size
                if self._covered and self._is_covered(record):
                    if replayed is None:
                        replayed = [False] * len(chunk.envelopes)
                    replayed.extend([True] * size)
                elif replayed is not None:
                    replayed.extend([False] * size)
                chunk.envelopes.extend(decoded)
                chunk.points.extend(decoded_points)
                chunk.partitions.extend([record.partition] * size)
                chunk.sizes.append(size)
            if not chunk.records:
                return done
            if self._since_yield >= self.round_events:  # a long stretch of processing: ingest's turn
                self._since_yield = 0
                self._yield_to_ingest()
            try:
                with self._lock:
                    self._process(chunk.records, chunk.envelopes, chunk.points, chunk.partitions, replayed,
                                  chunk.sizes)
                    self._measured(len(chunk.envelopes), largest, time.perf_counter() - chunk_started)
            except Exception:
                # a store is unavailable: records not yet through the stores are kept for a retry after
                # a backoff (doubling to MAX_BACKOFF_S); nothing of them is committed meanwhile
                later = ([carry[0]] if carry is not None else []) + list(todo[at:])
                if not self._through:      # the raw writes or the pipeline failed: this chunk again
                    self._retry = chunk.records + later
                else:                      # only the upserts failed: the chunk is through the pipeline
                    self._retry = later
                self._back_off()
                raise
            done += len(chunk.records)

    def _round_cap(self) -> int:
        """Envelopes per chunk (and, over a queue with one partition, per round): ``round_events``, cut by
        the time bound to what the recent rate processes in ``round_target_s`` (not below
        ``MIN_ROUND_EVENTS``)."""
        if self.round_target_s <= 0 or self.rate_events_per_s <= 0:
            return self.round_events
        fit = int(self.rate_events_per_s * self.round_target_s)
        return max(1, min(self.round_events, max(MIN_ROUND_EVENTS, fit)))

    def _record_room(self) -> int:
        """Room a round must still have to take more records: the recent largest record's envelopes (1
        while there is no time bound or no estimate yet: as before, more while the round is short at all),
        so a round takes no record that would overrun it."""
        if self.round_target_s <= 0 or not self.record_sizes:
            return 1
        return max(1, max(self.record_sizes))

    def _take_count(self, envelopes: int) -> int:
        """Records to take from the queue for ``envelopes`` envelopes of room: as many of the recent largest
        record as fit, ``batch`` at most, at least 1 (``batch`` itself while there is no time bound or no
        estimate yet). The largest of the last RECORD_WINDOW chunks, not the mean: a quiet run's
        one-envelope alert beside a noisy run's 500-envelope records must not make the next consume take
        several of the latter."""
        if self.round_target_s <= 0 or not self.record_sizes:
            return self.batch
        return max(1, min(self.batch, max(1, envelopes) // self._record_room()))

    def _measured(self, envelopes: int, largest: int, seconds: float) -> None:
        """Fold a chunk's figures -- its envelopes, its largest record's and the wall time from its first
        decode to the end of its _process -- into the running estimates (see ``RATE_WEIGHT``)."""
        self._since_yield += envelopes
        if not envelopes:
            return
        rate = envelopes / max(seconds, 1e-6)
        w = RATE_WEIGHT
        self.rate_events_per_s = (rate if self.rate_events_per_s <= 0
                                  else w * rate + (1 - w) * self.rate_events_per_s)
        self.record_sizes.append(largest)

    def _take_more(self, count: int) -> List[QueueRecord]:
        """The next ``count`` records, at once, for a round that wants more (:meth:`_round`); a consume that
        raises ends the taking ([]): the round goes on with the records it holds (handed out by the
        queue, they must go through before anything after them is committed) and the next round's
        consume meets the error again."""
        try:
            return self.queue.consume(count, 0.0)
        except Exception as exc:
            log.warning("taking more records for this round failed (%s); processing those taken",
                        _describe(exc))
            return []

    def _decode(self, record: QueueRecord) -> Tuple[List[Envelope], List[Points]]:
        try:
            return read_request(record.value)
        except Exception as exc:  # the gateway validated it; a bad record is a bug, not data
            self.stats.undecodable += 1
            log.error("undecodable queue record %s/%s: %s", record.partition, record.offset, exc)
            return [], []

    def _yield_to_ingest(self) -> None:
        busy = self.yield_to
        if busy is None:
            return
        end = time.monotonic() + self.max_yield_s
        while busy() and time.monotonic() < end:
            time.sleep(0.0005)

    def _is_covered(self, record: QueueRecord) -> bool:
        """Whether ``record`` went through its partition's pipeline before the snapshot it was restored
        from (redelivered because the crash came before that snapshot's queue commit)."""
        covered = self._covered.get(record.partition)
        if covered is None:
            return False
        top = covered.get(record.lane)
        return top is not None and record.offset <= top

    def _process(self, records: Sequence[QueueRecord], envelopes: Sequence[Envelope],
                 points: Sequence[Points], partitions: Sequence[int],
                 replayed: Optional[Sequence[bool]] = None, sizes: Optional[Sequence[int]] = None) -> None:
        """One chunk: raw context and points stored, the pipeline(s) run, their upserts applied. Envelopes
        ``replayed`` (their records the restored pipeline already has: :meth:`_is_covered`) are stored
        again but not handed to the pipeline. ``sizes``: each record's count of envelopes (what the worker
        pool needs; None: the records are decoded again to learn it)."""
        # whether this chunk went through its pipeline(s) (run_once's retry decision; before stop 43 it read
        # a non-empty _pending as that, and an output an earlier failure left there -- e.g. a Kafka
        # rebalance's save that could not apply it -- made a chunk whose raw writes failed count as through:
        # not retried, committed later without detection)
        self._through = False
        all_envelopes, all_points = envelopes, points
        if replayed is not None:
            envelopes = [e for e, skip in zip(envelopes, replayed) if not skip]
            points = [p for p, skip in zip(points, replayed) if not skip]
            partitions = [p for p, skip in zip(partitions, replayed) if not skip]
        started: Optional[PooledChunk] = None
        if self.pool is not None and envelopes:  # the workers run the pipelines while this stores
            if sizes is None:
                sizes = [len(self._decode(record)[0]) for record in records]
            started = self._start_pooled(records, all_envelopes, sizes, partitions)
        try:
            self._store_raw(all_envelopes, all_points)
        except BaseException:
            if started is not None:  # the chunk is retried: its pipelines rebuilt without it first
                assert self.pool is not None
                if started.started is not None:
                    self.pool.abandon(started.started)
            raise
        first = partitions[0] if partitions else PARTITION
        if not envelopes:
            pass  # every record of the chunk went through the pipeline before its restored snapshot
        elif started is not None:
            self._collect_pooled(started)
        elif partitions.count(first) == len(partitions):  # one partition (the usual case)
            self._run_pipeline(first, envelopes, points)
        else:  # records of several partitions: each partition's envelopes, in order, to its pipeline
            by_partition: Dict[int, Tuple[List[Envelope], List[Points]]] = {}
            for partition, env, pts in zip(partitions, envelopes, points):
                mine = by_partition.get(partition)
                if mine is None:
                    mine = by_partition[partition] = ([], [])
                mine[0].append(env)
                mine[1].append(pts)
            for partition, (envs, pts_list) in by_partition.items():
                self._run_pipeline(partition, envs, pts_list)
        # through the pipeline(s): committed at the next checkpoint, which waits for _pending (not before:
        # a chunk whose pipeline call failed -- a worker died -- is retried, and a checkpoint meanwhile, e.g.
        # a stop during the backoff, must not commit records no pipeline saw)
        self._uncommitted.extend(records)
        self._uncommitted_bytes += sum(map(len, map(_VALUE, records)))
        tops = self._tops
        # through the pipeline: what the next snapshot covers (OFFSETS_PREFIX)
        for partition, lane, offset in map(_PARTITION_LANE_OFFSET, records):
            lane_tops = tops.get(partition)
            if lane_tops is None:
                lane_tops = tops[partition] = {}
            if offset > lane_tops.get(lane, -1):
                lane_tops[lane] = offset
        if self._covered:  # a lane past its restored offset is forgotten: nothing at or below it comes again
            for record in records:
                covered = self._covered.get(record.partition)
                if covered is not None and record.offset > covered.get(record.lane, record.offset):
                    del covered[record.lane]
                    if not covered:
                        del self._covered[record.partition]
        now_ns = time.time_ns()
        if records:  # the oldest record of the chunks of the last LAG_WINDOW_S: how far behind the
            # most-behind run is (a fair queue hands out a quiet run's new records between a noisy one's)
            lags = self._lags
            lags.append((now_ns, max(0.0, (now_ns - min(map(_PUBLISHED, records))) / 1e9)))
            while lags and now_ns - lags[0][0] > LAG_WINDOW_S * 1e9:
                lags.popleft()
            self.stats.last_lag_s = max(lag for _, lag in lags)
        self.stats.records += len(records)
        self.stats.events += len(all_envelopes)
        self.stats.rounds += 1
        self._through = True
        if self.processed is not None:  # through the pipeline: never processed again, even if an upsert fails
            self.processed(backlog_counts(all_envelopes))
        self._apply_pending()

    def _start_pooled(self, records: Sequence[QueueRecord], envelopes: Sequence[Envelope],
                      sizes: Sequence[int], partitions: Sequence[int]) -> PooledChunk:
        """The pipelines' part of a chunk in the worker pool, sent: each partition with envelopes for its
        pipeline (``partitions``, the envelopes', in order) gets its records (``envelopes``: all of the
        chunk's, ``sizes`` per record) but those its restored snapshot covers and those of runs left out
        (:attr:`poisoned_runs`), every worker at once -- unless the last
        ``pool_isolate_after`` chunks failed: then nothing is sent yet (:meth:`_collect_pooled` runs them
        one run at a time). Returns what :meth:`_collect_pooled` reads."""
        order = list(dict.fromkeys(partitions))
        keyed: Dict[int, List[Tuple[RunId, JobRecord]]] = {p: [] for p in order}
        at = 0
        poisoned = self.poisoned_runs
        for record, size in zip(records, sizes):
            mine = keyed.get(record.partition)
            if mine is not None and not (self._covered and self._is_covered(record)):
                mine_envelopes = envelopes[at:at + size]
                run = (project_of(mine_envelopes), record.key)  # the queue key is the run id alone
                if not (poisoned and run in poisoned):
                    mine.append((run, record.value))
            at += size
        for partition in order:
            self._pipeline_for(partition)  # hosted on first use
        assert self.pool is not None
        jobs = [(p, keyed[p]) for p in order]
        if self._pool_failures >= self.pool_isolate_after:
            return PooledChunk(jobs, None)
        return PooledChunk(jobs, self.pool.start([(p, [r for _, r in mine]) for p, mine in jobs]))

    def _collect_pooled(self, chunk: PooledChunk) -> None:
        """The outputs of :meth:`_start_pooled`'s jobs become ``_pending`` in partition order (as in this
        thread); run one run at a time after failed chunks (:data:`~.pool.ISOLATE_AFTER`), a run whose
        records kill its worker is left out from then on (logged)."""
        assert self.pool is not None
        try:
            if chunk.started is not None:
                outputs = self.pool.collect(chunk.started)
            else:
                outputs, culprits = self.pool.process_runs(chunk.jobs)
                for run in culprits:
                    self.poisoned_runs.mark(run, self._pool_failures)
        except PoolFailed:
            self._pool_failures += 1
            raise
        self._pool_failures = 0
        for (partition, _), output in zip(chunk.jobs, outputs):
            self._emit_later(partition, output)
        self._report_quarantined()
        self._report_quotas()

    def _run_pipeline(self, partition: int, envelopes: Sequence[Envelope],
                      points: Sequence[Points]) -> None:
        """The pipeline's part of a chunk (a runtime that runs it elsewhere overrides this), given the
        metric points ``_store_raw`` read from each envelope (read once, shared): its output becomes
        ``_pending`` until the stores have it."""
        pipeline = self._pipeline_for(partition)
        assert isinstance(pipeline, Pipeline)
        self._emit_later(partition, pipeline.process(envelopes, points))
        self._report_quarantined()
        self._report_quotas()

    def _report_quotas(self) -> None:
        """Log a project that hit a per-project quota (the pipeline evicted its own runs or clusters): at
        most once per ``quota_log_interval_s`` per (project, quota), with the evictions since its last line
        (all of them are on /metrics as ``trainguard_project_quota_evictions_total``)."""
        hits = self.quota_evictions
        if not hits:
            return
        now = time.monotonic()
        for (project, quota), count in hits.items():
            logged, when = self._quota_logged.get((project, quota), (0, -self.quota_log_interval_s))
            if count > logged and now - when >= self.quota_log_interval_s:
                log.warning("project %r hit its %s quota: %d eviction(s) within the project since the last "
                            "report (%d in all); other projects are not affected -- raise project_max_%s in "
                            "TRAINGUARD_DETECTION_OVERRIDES if it is expected", project, quota,
                            count - logged, count, quota)
                self._quota_logged[(project, quota)] = (count, now)

    def _report_quarantined(self) -> None:
        """Log each run the pipeline quarantined since the last call (counted in its
        ``runs_quarantined``, on /metrics as ``trainguard_runs_quarantined_total``)."""
        for q in [q for pipeline in list(self.pipelines.values()) for q in pipeline.take_quarantined()]:
            log.error("run %r of project %r quarantined: %s -- its state is dropped and its later events "
                      "ignored; its records stay in the stores; every other run goes on", q.run_id, q.project,
                      q.reason)

    def _store_raw(self, envelopes: Sequence[Envelope], per_envelope: Sequence[Points]) -> None:
        """Raw context to the event store and metric points to the metric store (grouped by series in
        columns: :class:`~..storage.base.MetricColumns`), one write each (``per_envelope``: each envelope's
        points ``(name, step, value)``, None for one without metrics: decode.py)."""
        columns = MetricColumns()
        stored: List[StoredEvent] = []
        add = columns.add
        native = decode.NATIVE  # the native reader's add_points: MetricColumns.add's loop in C
        add_points = native.add_points if native is not None else None
        add_with = columns.add_with
        # its add_read: that loop over the plain batches' envelopes in C, up to the next envelope it does
        # not take (handled below, as without it, then add_read again from the one after)
        end = min(len(envelopes), len(per_envelope))
        add_read = native.add_read if native is not None and type(envelopes) is list and \
            type(per_envelope) is list and len(envelopes) == len(per_envelope) else None
        at = 0
        while at < end:
            if add_read is not None:
                at, added = add_read(columns.by_rank, envelopes, per_envelope, at)
                columns.count += added
                if at >= end:
                    break
            env, mine = envelopes[at], per_envelope[at]
            at += 1
            if isinstance(env, ReadEnvelope):  # a plain metric batch, read by read_request: never raw context
                if mine:
                    if add_points is None or type(mine) is not list:
                        add(env.project, env.run_id, env.rank, env.time_ns, mine)
                    else:
                        add_with(add_points, env.project, env.run_id, env.rank, env.time_ns, mine)
                continue
            project = env.get("project", "")
            run_id = env.get("run_id", "")
            rank = int(env.get("rank", 0))
            time_ns = int(env.get("time_unix_nano", 0))
            if mine:
                add(project, run_id, rank, time_ns, mine)
            if extract.is_raw_context(env):
                stored.append(StoredEvent(
                    event_id=env["event_id"], project=project, run_id=run_id, rank=rank,
                    host=env.get("host", ""), kind=_kind(env), severity=env.get("severity", "INFO"),
                    step=int(env.get("step", 0)), time_ns=time_ns, text=extract.raw_text(env),
                    payload=env))
        if columns.count:
            self._write_metrics(columns)
            self.stats.metric_points += columns.count
        if stored:
            try:
                self.events.put(stored)
            except EventsRejected as exc:  # the store wrote the rest of the batch
                if not exc.permanent:
                    self._unhold(columns)
                    raise  # unavailable for some of them: the round is retried
                self.stats.rejected_events += len(exc.rejected)  # refused for good: logged, not retried
                log.error("%s", exc)
            except BaseException:
                self._unhold(columns)  # the chunk is retried with its round: it holds them again then
                raise

    def _write_metrics(self, columns: MetricColumns) -> None:
        """A chunk's metric points to the metric store: held by the write-behind (:data:`METRIC_WRITE_
        CHUNKS`) and written with the held ones once ``metric_write_chunks`` chunks or
        ``metric_write_delay_s`` are reached. If that write fails, this chunk's are dropped from the held
        ones (its round is retried: it holds them again) and the earlier chunks' stay held."""
        held = self._held_metrics
        if not held:
            if self.metric_write_chunks <= 1 or self.metric_write_delay_s <= 0:
                self.metrics.put_columns(columns)  # no write-behind: one write per chunk
                return
            self._held_since = time.monotonic()
        held.append(columns)
        if (len(held) >= self.metric_write_chunks
                or time.monotonic() - self._held_since >= self.metric_write_delay_s):
            try:
                self._write_held_metrics()
            except BaseException:
                self._unhold(columns)
                raise

    def _unhold(self, columns: MetricColumns) -> None:
        """Forget ``columns`` if the write-behind still holds them (their chunk failed: it is retried)."""
        held = self._held_metrics
        if held and held[-1] is columns:
            held.pop()

    def _write_held_metrics(self) -> None:
        """Write every chunk's metric points the write-behind holds, in one transaction; on failure they
        stay held (written by the next call) and the error is raised."""
        held = self._held_metrics
        if not held:
            return
        if len(held) == 1:
            self.metrics.put_columns(held[0])
        else:
            self.metrics.put_columns_many(held)
        self._held_metrics = []

    def _emit_later(self, partition: int, output: PipelineOutput) -> None:
        """Queue ``partition``'s ``output`` for the stores (merged with one still pending: later records
        win)."""
        if output.is_empty():
            return
        held = self._pending.get(partition)
        self._pending[partition] = output if held is None else merge_outputs(held, output)

    def _apply_pending(self) -> None:
        """Write the pending outputs to the stores; one whose write raises stays pending (with the ones
        after it)."""
        for partition in list(self._pending):
            self._apply(partition, self._pending[partition])
            del self._pending[partition]

    def _apply(self, partition: int, output: PipelineOutput) -> None:
        """One write of ``output``'s records (:meth:`~..storage.base.IncidentStore.upsert_records`: one
        transaction on SQLite); over a partitioned queue the clusters are merged apart. Held metric points
        are written first when it has incidents (an incident is never in the store before its points)."""
        if output.incidents:
            self._write_held_metrics()
        try:
            self._upsert(partition, output.runs, output.incidents, output.clusters)
        except UNWRITABLE:
            output = self._apply_apart(partition, output)
        if output.runs or output.incidents or output.clusters:
            for listener in list(self.listeners):
                try:
                    listener(output)
                except Exception:
                    log.exception("processor listener failed")

    def _upsert(self, partition: int, runs: Sequence[Any], incidents: Sequence[Any],
                clusters: Sequence[Any]) -> None:
        if self.partitioned:  # every partition's pipeline holds its own view of a cluster: merged
            self.incidents.upsert_records(runs, incidents, ())
            if clusters:
                self.incidents.merge_clusters(f"partition/{partition}", clusters)
        else:
            self.incidents.upsert_records(runs, incidents, clusters)

    def _apply_apart(self, partition: int, output: PipelineOutput) -> PipelineOutput:
        """``output``'s records written one at a time after their joint write raised :data:`UNWRITABLE` (a
        value the store cannot take -- e.g. a time beyond SQL's 64 bits from a foreign state part): each
        record the store refuses that way is dropped for good (counted in ``rejected_records``, logged),
        so one bad record never holds the partition's other records and checkpoints back (before, the
        output was retried forever). Any other error -- the store unavailable -- propagates and the output
        stays pending, as before. Returns what was written."""
        return PipelineOutput(runs=self._each_alone(partition, "run", output.runs, 0),
                              incidents=self._each_alone(partition, "incident", output.incidents, 1),
                              clusters=self._each_alone(partition, "cluster", output.clusters, 2))

    def _each_alone(self, partition: int, what: str, items: Sequence[Any], slot: int) -> List[Any]:
        """``items`` (an output's runs, incidents or clusters: ``slot`` 0, 1, 2) each written in its own
        upsert; those the store refuses with :data:`UNWRITABLE` dropped (counted, logged); the written ones
        returned."""
        kept: List[Any] = []
        for item in items:
            alone: List[List[Any]] = [[], [], []]
            alone[slot].append(item)
            try:
                self._upsert(partition, *alone)
            except UNWRITABLE as exc:
                self.stats.rejected_records += 1
                log.error("the incident store refused %s %r of project %r for good (%s); it is dropped, the "
                          "partition's other records are written", what,
                          getattr(item, "incident_id", "") or getattr(item, "run_id", "") or
                          getattr(item, "fingerprint", ""), getattr(item, "project", ""), _describe(exc))
            else:
                kept.append(item)
        return kept

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
                due = self._next_timer_ns()  # wake up for the pipelines' next deadline (a stall)
                wait = 0.2 if not due else min(0.2, max(0.0, (due - time.time_ns()) / 1e9))
                self.run_once(timeout=wait)
            except Exception as exc:
                self.stats.errors += 1
                self.last_round_error = _describe(exc)
                log.exception("processing round failed; retrying")
                time.sleep(0.5)

    def problems(self) -> List[str]:
        """Why this processor cannot keep up with what is acknowledged right now (empty: it can): checkpoints
        failing (nothing is committed: the queue only grows) or rounds failing (a store unavailable). The
        runs left out of detection are :meth:`notes`, not problems: one project's run must not make the
        whole server unready (a readiness probe would take it out of service for every project)."""
        out: List[str] = []
        if self.last_checkpoint_error:
            out.append(f"checkpoints failing ({self.checkpoint_failures} in a row; nothing is committed): "
                       f"{self.last_checkpoint_error}")
        if self.last_round_error:
            out.append(f"processing failing (retrying with backoff): {self.last_round_error}")
        return out

    def notes(self) -> List[str]:
        """What /readyz shows beside its status without failing it: the runs left out of detection now (their
        records end a pipeline worker: :attr:`poisoned_runs`), one line each naming project and run."""
        return self.poisoned_runs.problems()

    def stop(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop the thread; with ``drain``, process what is queued first; always checkpoint -- all of it
        within ``timeout`` seconds (a store call that blocks can still overrun it: the server's shutdown
        deadline bounds that). Raises when a round or the checkpoint fails (what was not committed stays
        queued: :meth:`not_committed` says how much)."""
        end = time.monotonic() + timeout
        if self.pool is not None:  # a hung worker fails its call at the deadline instead of holding the stop
            self.pool.deadline = end
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        try:
            if drain:
                self.drain(max(0.0, end - time.monotonic()))
        finally:
            try:
                if self.pool is not None:  # the checkpoint's own bound (a hung worker is replaced first)
                    self.pool.deadline = time.monotonic() + self.pool.stop_timeout_s
                self.checkpoint()  # what went through is committed even when the drain failed part-way
            finally:
                if self.pool is not None:  # its workers exit (never outliving the processor)
                    self.pool.close()

    def halt(self, timeout: float = 5.0) -> None:
        """Stop the thread and end the pool's workers, with no drain and no checkpoint: for a start that
        failed after this was built (nothing it took is committed: the queue hands it out again)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.pool is not None:
            self.pool.close()

    def not_committed(self) -> str:
        """What this processor holds that is not committed yet, from memory alone (no store or queue call:
        safe when one of them hangs), e.g. for the shutdown's log line."""
        records = len(self._uncommitted) + len(self._retry)
        text = f"{records} queue record(s) taken but not committed"
        if self._pending:
            text += " (their last pipeline output not yet in the stores either)"
        return text

    def drain(self, timeout: float = 30.0) -> None:
        """Process until the queue has nothing uncommitted left to hand out (or ``timeout``)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.run_once(timeout=0.0) == 0:
                break


def backlog_counts(envelopes: Sequence[Envelope]) -> Dict[str, int]:
    """What the ``processed`` hook is handed for a chunk's ``envelopes``: ``{project: events}``, each envelope
    weighed as the gateway's backlog weighs it when admitting it (gateway/backlog.py: a metric batch one per
    point, at least one; anything else one) -- a plain metric batch read by read_request (a ReadEnvelope
    whose body is a :class:`~.decode.PlainBatch`) by its point count, known without rendering its dict (the
    request parsed again and a dict a point: that cost more than the rest of the processor outside the
    pipeline, sdk16 +6.1 us/event, env500 +6.9: bench/results/processor_store_issue15_stop40.txt), every
    other envelope by ``dict_weight`` of its mapping."""
    counts: Dict[str, int] = {}
    get = counts.get
    for e in envelopes:
        mapping: Mapping[str, Any]
        if isinstance(e, ReadEnvelope):
            body = e.body
            if isinstance(body, PlainBatch):
                counts[e.project] = get(e.project, 0) + (body.count or 1)
                continue
            mapping = e.raw
        else:
            mapping = e
        project = str(mapping.get("project", ""))
        counts[project] = get(project, 0) + dict_weight(mapping)
    return counts


_VALUE = attrgetter("value")
_PUBLISHED = attrgetter("published_ns")
_PARTITION_LANE_OFFSET = attrgetter("partition", "lane", "offset")


def _describe(exc: BaseException) -> str:
    """``Type: message`` of an error, bounded (for /readyz)."""
    return f"{type(exc).__name__}: {exc}"[:500]


def _kind(env: Dict[str, Any]) -> str:
    for kind in ("exception", "log", "lifecycle", "heartbeat", "memory", "metrics"):
        if kind in env:
            return kind
    return "unknown"

