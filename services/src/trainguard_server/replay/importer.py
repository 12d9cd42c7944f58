"""Build a finished run's envelopes from its files and send them through the ingest path.

Contract of :class:`Importer` (``Importer(options, backend).run()`` → :class:`ReplaySummary`):

* **Envelopes** are what the SDK would have sent for the same run: one lifecycle START per rank (before
  its first event), one metrics envelope per metrics record (at most :data:`MAX_POINTS` points each; a
  batch with a non-finite value carries ``alert="non_finite:<name>"`` and the ``recent`` values, severity
  ERROR, as the SDK does), one log envelope per kept log line, one exception envelope per traceback
  (``mechanism="log"``, ``recent_metrics`` from the rank's history), and one lifecycle EXIT per rank after
  everything else. Log and exception events carry the step of the rank's latest metrics record before
  them in the merged order (-1 before any; see **Times** for ties). Identity: ``run_id``, ``trace_id =
  run_id``, ``run_name``, ``project`` (empty: the token's), ``host``, ``rank``, ``world_size``
  (``options.world_size``, else highest rank + 1), ``sdk = "trainguard-replay/<version>"``.
* **Event ids are deterministic**: the first 32 hex digits of SHA-256 over (run_id, rank, source, key),
  source being ``metrics:<file name>``, ``log:<file name>``, ``start`` or ``exit`` and key the line
  number (plus ``.<chunk>`` for the second and later envelopes of a record). Replaying the same files
  under the same run id sends the same ids, which the stores and the pipeline keep once: re-importing is
  idempotent. (The pipeline remembers ``dedupe_ids_per_run`` = 10,000 notable ids per run -- logs,
  exceptions, lifecycle, non-finite metrics; a re-import of more than that is counted again, which is
  why log lines below ``min_log_level`` = WARNING are not *stored* by default. Every line is still read
  by the classifier (:func:`~trainguard_server.replay.recognised.classified`), and the ones it gives a
  kind are kept: an error line a job printed without a level, e.g. ``RuntimeError: NCCL communicator
  was aborted`` or ``loss is nan``, always reaches the pipeline. A log of which no line is kept at all
  sends its last ``tail_lines`` (50) lines instead, so the run shows what the job printed last.)
* **Times** (unix ns). A metrics file whose first timed object has a time field uses it (objects
  without one take the previous object's time); otherwise its records are spaced ``step_seconds`` apart,
  the last at the *anchor*: ``end_time_ns``, else the last log timestamp when a log has timestamps, else
  the modification time of the untimed files (when the job last wrote them). A log with timestamps: each
  item at its own or the last earlier timestamp (the first one before any); a log without: items spread
  evenly over the metrics' time span by line number. A log timestamp of precision *p* (1 ms for
  ``logging``'s ``,123``; :func:`.times.leading_stamp`) says the line was written within ``[t, t + p)``
  (a line without a stamp of its own, a traceback's, at or after the stamped line before it), so in the
  merged order a log item stands at the *end* of that interval, ``t + p - 1``: a metrics record timed
  within the same millisecond (µs times, as ``time.time()`` gives them) comes first -- a traceback
  printed after step N's record belongs to step N, not N - 1. Such an item is sent at ``t``, or at the
  rank's previous event time when that is later (still within the interval), so times follow the order.
  Re-importing the same files sends the same times. When the import would fall outside the gateway's
  window (older than ``max_past_age_s`` less one day, or more than a minute in the future) every time is
  shifted by the same whole number of days so that the latest lands within the last day (times of day
  and spacing kept; the same shift all day; tag ``replay.time_shift_s``). Files that span more than the
  window (less one day) cannot fit it: the summary's times note says so, and from which file time on the
  events are kept, and the rejected count says how many the backend refused ``out_of_range``
  (:attr:`ReplaySummary.too_old_expected`). START is 1 ms before a rank's first event; EXIT 1 ms after
  its last.
* **Exit codes**: ``exit_codes[rank]``, else ``exit_code``, else the one the input's format recorded
  (:meth:`.sources.base.Source.exit_code`: a W&B run's exit record, an MLflow run's FINISHED/FAILED
  status), else inferred: 1 when the rank's logs had a
  traceback, 0 otherwise. Codes 129..192 are reported as killed by signal code - 128. Given exit codes
  are sent even when the files held nothing importable (a quiet log of a SIGKILLed rank says only that).
* **Order and batching**: all sources are merged by (time, rank, source, line) and sent in batches of
  ``batch_size`` envelopes (smaller when a batch would exceed ~4 MiB); a batch the backend finds too
  large is split; retryable failures (connection, 429, 503) are retried with backoff for up to
  ``retry_timeout_s``, then the import stops with :attr:`ReplaySummary.error` set (what was sent stays; a
  re-run completes it). Non-retryable ones (401, 403, 400) stop it at once.
* Nothing in the files is fatal: malformed lines are counted and reported by line number
  (:class:`~.metrics_jsonl.MetricsStats`). When no record or log item could be read, nothing is sent.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import (
    Any,
    Callable,
    Deque,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Protocol,
    Sequence,
    Tuple,
)

from trainguard.core import events as ev
from trainguard.transport.base import SendResult, TransportError
from trainguard_engine.catalogue import signal_of_exit_code

from .. import __version__
from .backends import Backend
from .logs import LogItem, LogReader, LogStats, scan_log
from .metrics_jsonl import MetricsStats
from .recognised import classified
from .signals import Recognition, Recognizer
from .sources.base import MissingLibrary, Source, SourceOptions

SDK = f"trainguard-replay/{__version__}"
MAX_POINTS = 1000
MAX_BATCH_BYTES = 4 * 2**20
RECENT_PER_METRIC = 20        # the SDK's ``recent_metrics`` default
MAX_RECENT = 2000
MS = 1_000_000
DAY_NS = 86400 * 10**9
Event = Dict[str, Any]


class ProgressSink(Protocol):
    def start(self, total_bytes: int) -> None: ...

    def add_bytes(self, n: int) -> None: ...

    def update(self, events: int) -> None: ...


class _NoProgress:
    def start(self, total_bytes: int) -> None:
        pass

    def add_bytes(self, n: int) -> None:
        pass

    def update(self, events: int) -> None:
        pass


@dataclass
class ReplayOptions:
    """What to import and how (the CLI flags of ``trainguard replay``)."""

    run_id: str
    run_name: str = ""
    project: str = ""
    metrics: Sequence[Tuple[int, Path]] = ()    # (rank, JSON-lines file); a "rank" field routes an object
    inputs: Sequence[Tuple[int, Path, str]] = ()  # (rank, file or run folder, format; "" = detected)
    logs: Sequence[Tuple[int, Path]] = ()       # (rank of unprefixed lines, file); rank 0 yields to the
    #                                             one rank the file names as its own (LogScan.own_rank)
    exit_code: Optional[int] = None             # every rank's, unless exit_codes says otherwise
    exit_codes: Mapping[int, int] = field(default_factory=dict)
    world_size: Optional[int] = None
    mapping: Sequence[Tuple[str, str]] = ()
    auto_map: bool = True
    step_field: Optional[str] = None
    time_field: Optional[str] = None
    step_seconds: float = 1.0
    end_time_ns: Optional[int] = None
    min_log_level: str = "WARNING"              # "" keeps every line
    tail_lines: int = 50                        # a log of which no line is kept sends its last lines
    host: str = ""
    tags: Mapping[str, str] = field(default_factory=dict)
    batch_size: int = 500
    retry_timeout_s: float = 120.0
    max_past_age_s: float = 30 * 86400.0        # the gateway's default window


@dataclass
class SourceSummary:
    """One input file: what it is, how its times were set, and what reading it found."""

    kind: str                       # "metrics" | "log"
    path: Path
    rank: int
    index: int
    lines: int = 0
    first_ns: Optional[int] = None
    last_ns: Optional[int] = None
    span: Tuple[int, int] = (0, 0)
    time_mode: str = ""             # "file" | "spaced" | "timestamps" | "spread"
    ranks: List[int] = field(default_factory=list)
    metrics: Optional[MetricsStats] = None
    log: Optional[LogStats] = None
    reader: Optional[Source] = None
    step_total_ns: int = 0          # "from step times": the sum of the records' step durations

    @property
    def recognition(self) -> Optional[Recognition]:
        """What recognising this input's fields found (None: not a metrics input)."""
        return self.reader.recognizer.report if self.reader is not None else None

    @property
    def key(self) -> str:
        """The name event ids derive from (the file or run folder name)."""
        return self.reader.key if self.reader is not None else self.path.name

    @property
    def timed(self) -> bool:
        return self.first_ns is not None

    @property
    def malformed(self) -> int:
        return self.metrics.malformed if self.metrics is not None else 0

    @property
    def malformed_lines(self) -> List[Tuple[int, str]]:
        return self.metrics.malformed_lines if self.metrics is not None else []

    def describe(self) -> str:
        if self.metrics is not None:
            m = self.metrics
            fmt = f"{self.reader.format}: " if self.reader is not None else ""
            parts = [f"{fmt}{m.lines} lines, {m.records} records, {m.points} values"]
            step = ("line position (no step field)" if m.numbered else repr(m.step_field) if m.step_field
                    else "the format's step")
            parts.append(f"step from {step}")
            parts.append(f"times {self.time_mode}" + (f" ({m.time_field!r})" if m.time_field else ""))
            if m.malformed:
                parts.append(f"{m.malformed} malformed lines skipped")
            if m.no_step:
                parts.append(f"{m.no_step} objects without a step skipped")
            if m.no_values:
                parts.append(f"{m.no_values} objects without numeric values")
            if m.non_numeric:
                parts.append(f"{sum(m.non_numeric.values())} non-numeric values ignored")
            if m.dropped_by_map:
                parts.append(f"{m.dropped_by_map} values dropped by --map")
            said = "; ".join(parts)
            if self.recognition is not None:
                said += "".join(f"\n    {line}" for line in self.recognition.lines(m.non_numeric))
            return said
        if self.log is not None:
            g = self.log
            parts = [f"{g.lines} lines, {g.recognised} recognised by the classifier, {g.log_lines} log "
                     f"events, {g.exceptions} exceptions",
                     f"times {self.time_mode}", f"ranks {sorted(g.ranks) or self.ranks}"]
            if g.below_level:
                parts.append(f"{g.below_level} lines below the log level left out")
            return "; ".join(parts)
        return f"{self.lines} lines"


@dataclass
class ReplaySummary:
    """The outcome of one import."""

    run_id: str
    backend: str = ""
    sources: List[SourceSummary] = field(default_factory=list)
    built: Counter[str] = field(default_factory=Counter)      # envelopes by payload kind
    sent: int = 0
    accepted: int = 0
    duplicates: int = 0
    rejected: Counter[str] = field(default_factory=Counter)   # by code
    rejected_samples: List[str] = field(default_factory=list)
    exits: Dict[int, Tuple[int, bool]] = field(default_factory=dict)  # rank -> (exit code, inferred)
    time_shift_ns: int = 0
    time_note: str = ""
    too_old_expected: bool = False  # the files span more than the backend's window (see time_note)
    last_time_ns: int = 0           # the latest event time sent (EXIT)
    elapsed_s: float = 0.0
    error: str = ""
    origins: Dict[str, str] = field(default_factory=dict)  # event id of a log/exception -> "file:line"

    @property
    def ok(self) -> bool:
        """Something was imported and the import ran to its end."""
        return self.accepted > 0 and not self.error

    def reject(self, code: str, sample: str) -> None:
        self.rejected[code] += 1
        if len(self.rejected_samples) < 10:
            self.rejected_samples.append(sample)


class ReplayAborted(Exception):
    """The backend refused for good, or stayed unreachable past the retry timeout."""


MAX_ORIGINS = 100_000
"""Log and exception events whose file and line the summary remembers (to say which lines an incident
came from)."""


def event_id(run_id: str, rank: int, source: str, key: str) -> str:
    """The deterministic id of one replayed envelope (see the module doc)."""
    text = "\x1f".join(("trainguard-replay", run_id, str(rank), source, key))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


# ------------------------------------------------------------------------------------------------- items

@dataclass
class _Item:
    time_ns: int                    # its place in the merged order: the latest it can have been written
    rank: int
    src: int
    line: int
    kind: str                       # "metrics" | "log" | "exception"
    source: SourceSummary
    step: int = -1
    values: Optional[Dict[str, float]] = None
    log: Optional[LogItem] = None
    earliest_ns: Optional[int] = None   # a log item: the earliest it can have been written (None: time_ns)


def _key(item: _Item) -> Tuple[int, int, int, int]:
    return item.time_ns, item.rank, item.src, item.line


@dataclass
class _Rank:
    """What the builder knows about one rank while streaming."""

    history: Dict[str, Deque[Tuple[int, float]]] = field(default_factory=dict)
    started: bool = False
    last_step: int = -1
    last_ns: int = 0
    exceptions: int = 0

    def recent(self) -> List[Dict[str, Any]]:
        """The last values of every metric (loss and gradient norms first), oldest first per metric."""
        names = sorted(self.history, key=lambda n: (n.startswith("grad/layer/"), n))
        out: List[Dict[str, Any]] = []
        for name in names:
            out.extend({"name": name, "step": s, "value": ev.wire_float(v)} for s, v in self.history[name])
            if len(out) >= MAX_RECENT:
                return out[:MAX_RECENT]
        return out


class _Builder:
    """Items in merged order → envelopes (with a size estimate and where they came from)."""

    def __init__(self, options: ReplayOptions, world_size: int, tags: Mapping[str, str]) -> None:
        self.options = options
        self.world_size = world_size
        self.tags = dict(tags)
        self.ranks: Dict[int, _Rank] = {}
        self.items = 0

    def base(self, rank: int) -> Dict[str, Any]:
        o = self.options
        self.world_size = max(self.world_size, rank + 1)
        return {"project": o.project, "run_id": o.run_id, "trace_id": o.run_id, "host": o.host, "pid": 0,
                "rank": rank, "local_rank": 0, "world_size": self.world_size, "group_rank": -1,
                "run_name": o.run_name or o.run_id, "sdk": SDK}

    def _id(self, rank: int, source: str, key: str) -> str:
        return event_id(self.options.run_id, rank, source, key)

    def start(self, rank: int, time_ns: int) -> Tuple[Event, str, int]:
        payload = {"phase": "START", "argv": [], "tags": ev.string_map(self.tags), "config": {}}
        event = ev.envelope(self.base(rank), "lifecycle", payload, step=0, time_unix_nano=time_ns,
                            severity="INFO", event_id=self._id(rank, "start", ""))
        return event, f"rank {rank} start", 1000

    def item(self, item: _Item) -> List[Tuple[Event, str, int]]:
        self.items += 1
        state = self.ranks.get(item.rank)
        if state is None:
            state = self.ranks[item.rank] = _Rank()
        out: List[Tuple[Event, str, int]] = []
        time_ns = item.time_ns
        if item.earliest_ns is not None:  # within [earliest, latest]: no earlier than what came before
            time_ns = min(item.time_ns, max(item.earliest_ns, state.last_ns))
        if not state.started:
            state.started = True
            out.append(self.start(item.rank, time_ns - MS))
        state.last_ns = max(state.last_ns, time_ns)
        where = f"{item.source.path.name}:{item.line}"
        if item.kind == "metrics":
            assert item.values is not None
            out.extend(self._metrics(item, state, where))
        elif item.log is not None:
            out.append(self._log(item, state, where, time_ns))
        return out

    def _metrics(self, item: _Item, state: _Rank, where: str) -> List[Tuple[Event, str, int]]:
        values = item.values or {}
        alert = ""
        for name, value in values.items():
            if value - value != 0.0:
                alert = f"non_finite:{name}"
                break
        if alert.startswith("non_finite:grad/") and values.get("amp/overflow") == 1.0:
            alert = ""  # a routine fp16 overflow, as the SDK treats it
        recent = state.recent() if alert else []
        names = list(values)
        source = f"metrics:{item.source.key}"
        out: List[Tuple[Event, str, int]] = []
        for chunk, lo in enumerate(range(0, len(names), MAX_POINTS)):
            part = {n: values[n] for n in names[lo:lo + MAX_POINTS]}
            first = chunk == 0 and bool(alert)
            payload = ev.metrics_payload(part)
            if first:
                payload["alert"] = alert
                payload["recent"] = recent
            key = str(item.line) if chunk == 0 else f"{item.line}.{chunk}"
            event = ev.envelope(self.base(item.rank), "metrics", payload, step=item.step,
                                time_unix_nano=item.time_ns, severity="ERROR" if first else "INFO",
                                event_id=self._id(item.rank, source, key))
            out.append((event, where, 400 + 60 * len(part) + (70 * len(recent) if first else 0)))
        for name, value in values.items():
            series = state.history.get(name)
            if series is None:
                series = state.history[name] = deque(maxlen=RECENT_PER_METRIC)
            series.append((item.step, value))
        state.last_step = item.step
        return out

    def _log(self, item: _Item, state: _Rank, where: str, time_ns: int) -> Tuple[Event, str, int]:
        log = item.log
        assert log is not None
        source = f"log:{item.source.path.name}"
        if log.kind == "exception":
            state.exceptions += 1
            payload = dict(log.payload)
            recent = state.recent()
            if recent:
                payload["recent_metrics"] = recent
            event = ev.envelope(self.base(item.rank), "exception", payload, step=state.last_step,
                                time_unix_nano=time_ns, severity="CRITICAL",
                                event_id=self._id(item.rank, source, str(log.line)))
            return event, where, len(json.dumps(payload, default=str)) + 400
        payload = {"logger": "", "level": log.level, "message": log.message,
                   "source": f"file:{item.source.path.name}"}
        event = ev.envelope(self.base(item.rank), "log", payload, step=state.last_step,
                            time_unix_nano=time_ns,
                            severity=log.level if log.level in ev.SEVERITIES else "INFO",
                            event_id=self._id(item.rank, source, str(log.line)))
        return event, where, 400 + 2 * len(log.message)

    def exits(self, default_ns: int, summary: ReplaySummary) -> List[Tuple[Event, str, int]]:
        """One EXIT per rank (and START for ranks known only from their exit code), by time."""
        o = self.options
        ranks = set(self.ranks) | set(o.exit_codes)
        out: List[Tuple[Event, str, int]] = []
        order = sorted(ranks, key=lambda r: (self.ranks[r].last_ns if r in self.ranks else default_ns, r))
        for rank in order:
            state = self.ranks.get(rank)
            if state is None:
                state = self.ranks[rank] = _Rank(started=True, last_ns=default_ns)
                out.append(self.start(rank, default_ns - MS))
            code = o.exit_codes.get(rank, o.exit_code)
            inferred = code is None
            if code is None:
                code = 1 if state.exceptions else 0
            signal = signal_of_exit_code(code)
            reason = ("normal" if code == 0 else "signal" if signal
                      else "exception" if state.exceptions else "sys.exit")
            payload = {"phase": "EXIT", "exit_code": code, "signal": signal, "reason": reason}
            time_ns = (state.last_ns or default_ns) + MS
            summary.last_time_ns = max(summary.last_time_ns, time_ns)
            summary.exits[rank] = (code, inferred)
            event = ev.envelope(self.base(rank), "lifecycle", payload, step=state.last_step,
                                time_unix_nano=time_ns, severity="INFO" if code == 0 else "ERROR",
                                event_id=self._id(rank, "exit", ""))
            out.append((event, f"rank {rank} exit", 1000))
        return out


# ------------------------------------------------------------------------------------------------ sender

class _Sender:
    """Batches envelopes and delivers them (split on 413, retry on retryable errors)."""

    def __init__(self, backend: Backend, options: ReplayOptions, summary: ReplaySummary,
                 progress: ProgressSink, sleep: Callable[[float], None] = time.sleep) -> None:
        self.backend = backend
        self.options = options
        self.summary = summary
        self.progress = progress
        self.sleep = sleep
        self.events: List[Event] = []
        self.origins: List[str] = []
        self.bytes = 0

    def add(self, event: Event, origin: str, size: int) -> None:
        kind = ev.payload_kind(event) or "?"
        self.summary.built[kind] += 1
        full = len(self.events) >= self.options.batch_size or self.bytes + size > MAX_BATCH_BYTES
        if self.events and full:
            self.flush()
        self.events.append(event)
        self.origins.append(origin)
        self.bytes += size

    def flush(self) -> None:
        if self.events:
            events, origins = self.events, self.origins
            self.events, self.origins, self.bytes = [], [], 0
            self._deliver(events, origins)
            self.progress.update(self.summary.sent)

    def _deliver(self, events: List[Event], origins: List[str]) -> None:
        deadline = time.monotonic() + self.options.retry_timeout_s
        backoff = 0.5
        while True:
            try:
                result = self.backend.send(events, 60.0)
                break
            except TransportError as exc:
                too_large = exc.status == "413" or "larger than max" in str(exc)
                if too_large and len(events) > 1:
                    half = len(events) // 2
                    self._deliver(events[:half], origins[:half])
                    self._deliver(events[half:], origins[half:])
                    return
                if too_large:
                    self.summary.sent += 1
                    self.summary.reject("too_large", f"{origins[0]}: {exc}")
                    return
                if not exc.retryable:
                    raise ReplayAborted(f"{self.backend.description} refused the import: {exc}") from None
                if time.monotonic() >= deadline:
                    raise ReplayAborted(f"{self.backend.description} unavailable for "
                                        f"{self.options.retry_timeout_s:.0f} s: {exc}") from None
                self.sleep(min(exc.retry_after or backoff, max(0.0, deadline - time.monotonic())))
                backoff = min(backoff * 2, 10.0)
        self._count(result, events, origins)

    def _count(self, result: SendResult, events: List[Event], origins: List[str]) -> None:
        s = self.summary
        s.sent += len(events)
        s.accepted += result.accepted
        s.duplicates += result.duplicates
        for rejected in result.rejected:
            index = rejected.get("index")
            origin = origins[index] if isinstance(index, int) and 0 <= index < len(origins) else "?"
            s.reject(str(rejected.get("code", "rejected")), f"{origin}: {rejected.get('message', '')}")


# ---------------------------------------------------------------------------------------------- importer

class Importer:
    """Plans the times, streams every source in merged order and sends (see the module doc)."""

    def __init__(self, options: ReplayOptions, backend: Backend, *,
                 progress: Optional[ProgressSink] = None, clock: Callable[[], int] = time.time_ns,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.options = options
        self.backend = backend
        self.progress: ProgressSink = progress or _NoProgress()
        self.clock = clock
        self.sleep = sleep
        self.summary = ReplaySummary(run_id=options.run_id, backend=backend.description)
        self.shift = 0
        self.anchor = 0

    # -- plan ---------------------------------------------------------------------------------------------
    def plan(self) -> List[SourceSummary]:
        """Scan every file once (cheaply) and fix each source's time mode and span, and the shift."""
        o = self.options
        now = self.clock()
        dt = int(o.step_seconds * 1e9)
        readers = [(rank, self._open(Path(path), "jsonl")) for rank, path in o.metrics]
        readers += [(rank, self._open(Path(path), fmt)) for rank, path, fmt in o.inputs]
        sizes = [reader.size() for _, reader in readers]
        sizes += [2 * Path(p).stat().st_size for _, p in o.logs]  # scanned, then read
        self.progress.start(sum(sizes))
        sources: List[SourceSummary] = []
        for rank, reader in readers:
            src = SourceSummary("metrics", reader.path, rank, len(sources), reader=reader)
            src.lines, src.first_ns, src.last_ns = reader.peek()
            src.ranks = [rank]
            sources.append(src)
        for rank, path in o.logs:
            src = SourceSummary("log", Path(path), rank, len(sources))
            scan = scan_log(src.path, rank, on_bytes=self.progress.add_bytes)
            src.lines, src.first_ns, src.last_ns = scan.lines, scan.first_ns, scan.last_ns
            src.rank = scan.own_rank(rank)  # a paste given as rank 0 whose text names its own rank
            src.ranks = [src.rank] if src.rank != rank else scan.ranks
            sources.append(src)
        metrics = [s for s in sources if s.kind == "metrics"]
        logs = [s for s in sources if s.kind == "log"]
        log_last = max((s.last_ns for s in logs if s.last_ns is not None), default=None)
        untimed = [s for s in sources if not s.timed]
        if o.end_time_ns is not None:
            self.anchor = o.end_time_ns
        elif log_last is not None and any(not s.timed for s in metrics):
            self.anchor = log_last
        elif untimed:  # when the job last wrote them: deterministic, so a re-import sends the same times
            self.anchor = max(_mtime_ns(s.path) for s in untimed)
        else:
            self.anchor = now
        for src in metrics:
            if src.timed:
                assert src.first_ns is not None
                last = src.last_ns if src.last_ns is not None else src.first_ns
                src.span, src.time_mode = (min(src.first_ns, last), max(src.first_ns, last)), "from the file"
            elif self._step_times(src, dt):
                src.span = (self.anchor - src.step_total_ns, self.anchor)
                src.time_mode = f"from the step-time field ({_STEP_TIME})"
            else:
                src.span = (self.anchor - max(0, src.lines - 1) * dt, self.anchor)
                src.time_mode = f"spaced {o.step_seconds:g} s apart"
        spans = [s.span for s in metrics] or [
            (s.first_ns, s.last_ns) for s in logs if s.first_ns is not None and s.last_ns is not None]
        data = (min(lo for lo, _ in spans), max(hi for _, hi in spans)) if spans else None
        for src in logs:
            if src.timed:
                assert src.first_ns is not None and src.last_ns is not None
                src.span, src.time_mode = (src.first_ns, src.last_ns), "from line timestamps"
            elif data is not None:
                src.span, src.time_mode = data, "spread over the metrics' time span"
            else:
                src.span = (self.anchor - max(0, src.lines - 1) * MS, self.anchor)
                src.time_mode = "spread 1 ms apart"
        if sources:
            lo = min(s.span[0] for s in sources)
            hi = max(s.span[1] for s in sources)
            oldest = now - int(o.max_past_age_s * 1e9) + DAY_NS
            if hi > now + 60 * 10**9 or lo < oldest:
                self.shift = (now - hi) // DAY_NS * DAY_NS  # whole days: the same shift all day long
                self.summary.time_note = (f"shifted by {self.shift // DAY_NS:+,} days (times of day and "
                                          f"spacing kept) to fit the backend's time window")
            if hi - lo > int(o.max_past_age_s * 1e9) - DAY_NS:  # longer than the window: the oldest refused
                self.summary.too_old_expected = True
                cut = now - int(o.max_past_age_s * 1e9) - self.shift  # in the files' own times
                note = (f"the files span {(hi - lo) / DAY_NS:,.1f} days, more than the backend's window "
                        f"(max past age {o.max_past_age_s / 86400:g} days): events before {_date(cut)} "
                        f"(file time) will be refused as out of range")
                self.summary.time_note = "; ".join(filter(None, (self.summary.time_note, note)))
        self.summary.time_shift_ns = self.shift
        self.summary.sources = sources
        return sources

    # -- streams ------------------------------------------------------------------------------------------
    def _open(self, path: Path, fmt: str) -> Source:
        """A reader of one metrics input with its own recognizer (it remembers its fields' units)."""
        from .sources.registry import open_source

        o = self.options
        try:
            return open_source(path, fmt, Recognizer(o.mapping, auto=o.auto_map),
                               SourceOptions(o.step_field, o.time_field, self.progress.add_bytes))
        except ValueError as exc:
            raise ReplayAborted(str(exc)) from None

    def _step_times(self, src: SourceSummary, dt: int) -> bool:
        """An untimed source whose records carry a step time: sum them (a pass over a fresh reader) into
        ``src.step_total_ns``; False when no record has one."""
        assert src.reader is not None
        total = 0
        found = False
        for rec in src.reader.clone():
            d = rec.values.get(_STEP_TIME)
            if d is not None and d == d and 0 < d < 86400 * 365:
                total += int(d * 1e9)
                found = True
            else:
                total += dt
        src.step_total_ns = total
        return found

    def _metrics_items(self, src: SourceSummary) -> Iterator[_Item]:
        o = self.options
        reader = src.reader
        assert reader is not None
        src.metrics = reader.stats
        dt = int(o.step_seconds * 1e9)
        carry = src.first_ns or 0
        done = 0
        for rec in reader:
            if src.timed:
                time_ns = rec.time_ns if rec.time_ns is not None else carry
                carry = time_ns
            elif src.step_total_ns:
                d = rec.values.get(_STEP_TIME)
                done += int(d * 1e9) if d is not None and d == d and 0 < d < 86400 * 365 else dt
                time_ns = self.anchor - (src.step_total_ns - done)
            else:
                time_ns = self.anchor - (src.lines - 1 - rec.position) * dt
            rank = rec.rank if rec.rank is not None else src.rank
            yield _Item(time_ns + self.shift, rank, src.index, rec.line, "metrics", src, step=rec.step,
                        values=rec.values)

    def _log_items(self, src: SourceSummary) -> Iterator[_Item]:
        reader = LogReader(src.path, src.rank, min_level=self.options.min_log_level,
                           on_bytes=self.progress.add_bytes, keep_below=classified,
                           tail=self.options.tail_lines)
        src.log = reader.stats
        lo, hi = src.span
        last_index = max(1, src.lines - 1)
        for item in reader:
            if src.timed and item.time_ns is not None:  # written within [stamp, stamp + precision)
                earliest, latest = item.time_ns, item.time_ns + max(1, item.precision_ns) - 1
            elif src.timed:  # before the first stamp
                assert src.first_ns is not None
                earliest = latest = src.first_ns
            else:
                earliest = latest = lo + (hi - lo) * min(item.last_line - 1, last_index) // last_index
            yield _Item(latest + self.shift, item.rank, src.index, item.line, item.kind, src, log=item,
                        earliest_ns=earliest + self.shift)

    # -- run ----------------------------------------------------------------------------------------------
    def run(self) -> ReplaySummary:
        """Plan, stream, send; never raises for file content or backend refusals (see ``error``)."""
        started = time.monotonic()
        summary = self.summary
        o = self.options
        try:
            sources = self.plan()
            known = [r for s in sources for r in s.ranks] + list(o.exit_codes)
            world = o.world_size or (max(known) + 1 if known else 1)
            tags = {"replay": "true", "launcher": "replay",
                    "replay.files": ",".join(s.key for s in sources)}
            if self.shift:
                tags["replay.time_shift_s"] = f"{self.shift / 1e9:.0f}"
            tags.update(o.tags)
            builder = _Builder(o, world, tags)
            sender = _Sender(self.backend, o, summary, self.progress, self.sleep)
            streams: List[Iterable[_Item]] = [
                self._metrics_items(s) if s.kind == "metrics" else self._log_items(s) for s in sources]
            for item in heapq.merge(*streams, key=_key):
                for event, origin, size in builder.item(item):
                    if item.log is not None and len(summary.origins) < MAX_ORIGINS:
                        summary.origins[event["event_id"]] = origin
                    sender.add(event, origin, size)
            if builder.items == 0 and not o.exit_codes and o.exit_code is None:
                summary.error = "nothing to import: no metrics record and no log line could be read"
            else:
                recorded = {s.rank: code for s in sources if s.reader is not None
                            for code in [s.reader.exit_code()] if code is not None}
                if recorded and o.exit_code is None:  # the format's own record of how the run ended
                    builder.options = replace(o, exit_codes={**recorded, **o.exit_codes})
                default_ns = max((s.span[1] for s in sources), default=self.anchor) + self.shift
                for event, origin, size in builder.exits(default_ns, summary):
                    sender.add(event, origin, size)
                sender.flush()
        except (ReplayAborted, MissingLibrary) as exc:
            summary.error = str(exc)
        except OSError as exc:
            name = getattr(exc, "filename", "") or "an input file"
            summary.error = f"cannot read {name}: {exc.strerror or exc}"
        summary.elapsed_s = time.monotonic() - started
        return summary


_STEP_TIME = "time/step_s"


def _date(ns: int) -> str:
    """``ns`` as a local date and time to the second (what the summary says)."""
    return datetime.fromtimestamp(ns / 1e9).strftime("%Y-%m-%d %H:%M:%S")


def _mtime_ns(path: Path) -> int:
    """When the job last wrote ``path`` (a folder: its newest file)."""
    if path.is_dir():
        files = (p.stat().st_mtime_ns for p in path.rglob("*") if p.is_file())
        return max(files, default=path.stat().st_mtime_ns)
    return path.stat().st_mtime_ns


def wait_for_run(backend: Backend, summary: ReplaySummary, *, timeout_s: float = 120.0,
                 sleep: Callable[[float], None] = time.sleep) -> Tuple[Optional[Dict[str, Any]], bool]:
    """Make the backend process the import, then poll until the run shows every rank's exit and either an
    event at least as late as the latest one sent or the backend caught up with everything ingested
    before (a re-import whose events were all duplicates changes nothing else); (run record or None,
    whether it got there within ``timeout_s``)."""
    backend.mark()
    backend.finish()
    if not backend.can_report:
        return None, False
    deadline = time.monotonic() + timeout_s
    run: Optional[Dict[str, Any]] = None
    while True:
        run = backend.run(summary.run_id)
        if run is not None and _exited(run, summary) and (_reached(run, summary) or backend.caught_up()):
            return run, True
        if time.monotonic() >= deadline:
            return run, False
        sleep(0.2)


def _exited(run: Mapping[str, Any], summary: ReplaySummary) -> bool:
    codes = run.get("exit_codes") or {}
    return all(str(rank) in codes for rank in summary.exits)


def _reached(run: Mapping[str, Any], summary: ReplaySummary) -> bool:
    last = run.get("last_event_ns") or 0
    return bool(isinstance(last, (int, float)) and not math.isnan(last) and last >= summary.last_time_ns)
