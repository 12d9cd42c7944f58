"""The pure pipeline: envelopes in, run/incident/cluster records out (DESIGN §2 rule 1).

::

    pipeline = Pipeline(DetectionSettings())
    out = pipeline.process(events)        # envelope dicts in the JSON mapping, in arrival order
    out = pipeline.advance(now_ns)        # processing-time timers: lost runs, eviction
    blob = pipeline.snapshot()            # bytes (versioned JSON)
    pipeline = Pipeline.restore(blob, settings)

**Contract.**

* *Pure and deterministic*: no I/O, no clock, no randomness. Event time is the envelopes'
  ``time_unix_nano``; processing time is only what a runtime passes to :meth:`Pipeline.advance`. The same
  inputs in the same order give the same outputs, in every runtime (embedded, Flink).
* *Upserts*: a :class:`PipelineOutput` holds every record that changed, whole, in a deterministic order.
  Applying an output twice leaves a store as applying it once.
* *Idempotent under replay* (at-least-once delivery): duplicates of exceptions, lifecycle, logs and alert
  or non-finite metric batches are dropped by event id (remembered per run, ``dedupe_ids_per_run``);
  everything else folds in idempotently by construction (steps and times are maxima, histories are keyed
  by step, a heartbeat not newer than the rank's last is ignored). Replaying a stream changes nothing and
  emits nothing.
* *Snapshots*: :meth:`snapshot` → :meth:`restore` → continue gives exactly the outputs of running straight
  through (the digests of the records last emitted are part of the state).
* *Bounded*: every collection is capped by a setting (see :mod:`trainguard_engine.state`); ended runs are
  evicted ``ended_run_ttl_s`` after their last event, others after ``idle_run_ttl_s``; at most
  ``max_runs`` runs and ``max_clusters`` clusters are kept (these two and ``evicted_runs_remembered`` are
  read from the pipeline's default settings; everything else from the event's project's settings).
* *Per-project quotas* (:mod:`.quotas`): runs, clusters, incidents and state bytes per project; a project
  beyond a quota, or holding the most when the pipeline is full, loses its own runs or clusters -- never
  another project's. :attr:`Pipeline.quota_evictions` counts them per (project, quota). The memory of
  evicted runs is shared fairly too (:class:`~.quotas.EvictedRuns`): a project's flood of run ids makes it
  forget its own evicted runs, never another project's (security.md H48).
* *Never raises on input*: an envelope that cannot be read (no payload, no run id, a non-integer step) is
  counted in ``counters["malformed"]`` and skipped.
* *One run cannot stop the others* (issue 18, finding 1): no record and no state holds a non-finite
  number -- detectors sanitise what they compute, legitimate non-finite evidence is spelled as the JSON
  mapping spells it (``"NaN"``, ``"Infinity"``), and a record that would still hold one is spelled out the
  same way and counted (``nonfinite_encoded``). A run that cannot go on -- an event whose processing
  raises (a detector bug its data meets), a state that cannot be serialised at a snapshot, a stored part
  that cannot be read back at a restore -- is *quarantined*: its state is dropped (its records already
  emitted stay in the stores, and whatever of them changed goes out with the next output), its later
  events are dropped like an evicted run's (``late``), it is counted in ``runs_quarantined`` and listed,
  with the error, in :attr:`Pipeline.quarantined` for the runtime to log. Every other run goes on and
  every snapshot serialises.

**Run status**, by precedence: ``failed`` (a rank exited non-zero or by a signal) > ``finished`` (every
rank exited 0, at least world_size ranks seen) > ``lost`` (silent, see :mod:`.detectors.progress`) >
``stalled`` (an open stall incident) > ``running``. **Health**: ``critical`` when an open incident is of
severity error or critical, ``warning`` for warning, else ``healthy``.
"""

from __future__ import annotations

import hashlib
import json
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from operator import itemgetter
from typing import (
    Any,
    Dict,
    Final,
    FrozenSet,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Set,
    Tuple,
    TypeVar,
    Union,
)

from . import clusters as clusters_mod
from . import correlate, diagnosis, shards
from . import incidents as incident_mod
from .catalogue import DetectionSettings
from .detectors import progress, straggler
from .detectors.base import Detector, EventInfo, MetricBatch, MetricRun, RunFindings, new_batch
from .detectors.registry import DETECTORS
from .envelope import ReadEnvelope
from .extract import as_float, as_int, as_str, batch_points, payload, recent_points
from .incidents import Finding
from .quotas import EvictedRuns, ProjectIndex
from .records import (
    RUN_FAILED,
    RUN_FINISHED,
    RUN_LOST,
    RUN_RUNNING,
    RUN_STALLED,
    Cluster,
    Incident,
    RunRecord,
    finite_copy,
)
from .run_part import RunPart
from .state import ClusterState, IncidentState, RankState, RunState, cluster_key, run_key

SNAPSHOT_FORMAT = "trainguard.pipeline"
SNAPSHOT_VERSION = 1

COUNTERS = ("events", "duplicates", "malformed", "late", "ranks_dropped", "incidents_suppressed",
            "runs_evicted", "clusters_evicted", "runs_quarantined", "nonfinite_encoded")
"""``Pipeline.counters``: events seen; replayed duplicates dropped; malformed envelopes skipped; events
for runs already evicted or quarantined (dropped); events of ranks beyond max_ranks_per_run; findings
dropped because a run had max_incidents_per_run incidents; runs and clusters evicted; runs quarantined
(see the module docstring); records in which a non-finite number was spelled out."""

QUARANTINE_REASON_CHARS = 2000
"""Longest error text kept with a quarantined run (:attr:`Pipeline.quarantined`)."""
QUARANTINE_LIST_MAX = 1000
"""Most quarantined runs listed in :attr:`Pipeline.quarantined` until the runtime takes them (the counter
counts them all)."""


PLAIN_BODIES: Final[Set[type]] = set()
"""Types of a :class:`ReadEnvelope`'s ``body`` that hold neither ``alert`` nor ``recent`` by construction:
a runtime's reader of plain metric batches registers its own with :func:`plain_body` (the processor's
``trainguard_server.processor.decode.PlainBatch``). The pipeline does not ask such a body for them -- two
Python ``get`` calls per envelope on a mapping that would answer None (issue 15) --; any other body
(a dict, a subclass) is asked as before. A type registered here must answer None to ``get("alert")`` and
``get("recent")`` for every instance (tests/engine/test_plain_body.py checks the processor's)."""


_Body = TypeVar("_Body", bound=type)


def plain_body(cls: _Body) -> _Body:
    """Register ``cls`` in :data:`PLAIN_BODIES` (a class decorator: returns it unchanged)."""
    PLAIN_BODIES.add(cls)
    return cls


@dataclass(frozen=True)
class Quarantined:
    """A run whose state was dropped because it could not go on (see the module docstring)."""

    project: str
    run_id: str
    reason: str

_PHASE_START = ("START", 1, "1")
_PHASE_EXIT = ("EXIT", 2, "2")


@dataclass
class PipelineOutput:
    """Every record that changed, whole (copies: the pipeline keeps mutating its own)."""

    runs: List[RunRecord] = field(default_factory=list)
    incidents: List[Incident] = field(default_factory=list)
    clusters: List[Cluster] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.runs or self.incidents or self.clusters)


def merge_outputs(first: PipelineOutput, then: PipelineOutput) -> PipelineOutput:
    """One output equal, upserted, to upserting ``first`` then ``then`` (a record of ``then`` replaces
    the same record of ``first``; order: ``first``'s records, then the new ones)."""
    runs = {(r.project, r.run_id): r for r in first.runs}
    runs.update(((r.project, r.run_id), r) for r in then.runs)
    incidents = {(i.project, i.incident_id): i for i in first.incidents}
    incidents.update(((i.project, i.incident_id), i) for i in then.incidents)
    clusters = {(c.project, c.fingerprint): c for c in first.clusters}
    clusters.update(((c.project, c.fingerprint), c) for c in then.clusters)
    return PipelineOutput(list(runs.values()), list(incidents.values()), list(clusters.values()))


class _Ahead:
    """The run of envelopes (``indices``, every one of the rank routed to the detector below ``end``) an
    independent detector was handed for ``rank``, what it found on each, and the position whose findings
    are due next."""

    def __init__(self, rank: RankState, indices: List[int], end: int, pos: int, found: RunFindings) -> None:
        self.rank, self.indices, self.end, self.pos, self.found = rank, indices, end, pos, found


class _Route(NamedTuple):
    """What one list of point names asks of the pipeline, the same for every batch carrying it: the
    names as a set, whether one is a shard's norm, the positions of those the diagnosis keeps (memory
    peaks, LR changes), and the detectors to call -- ``(detector, ask)``: ``ask`` False for a ``names_only``
    detector whose :meth:`~.detectors.base.Detector.wants` said yes once, or another whose
    :meth:`~.detectors.base.Detector.wants_names` said yes (those that said no are left out), True for the
    others (asked per batch): see :func:`_asking`."""

    names: FrozenSet[str]
    sharded: bool
    diagnosis: Tuple[int, ...]
    detectors: Tuple[Tuple[Detector, bool], ...]
    columns: Tuple[Detector, ...]
    """Those of ``detectors`` that declare ``independent`` (the column hook)."""
    keep: Tuple[bool, ...]
    """For each point of the list, whether its name has a history (``settings.keeps_history``)."""


ROUTES_MAX = 1024
"""Most point-name lists whose :class:`_Route` a pipeline remembers per settings object (then it starts
afresh): derived from the code and the settings (not the state), never snapshotted."""
RUN_MAX = 64
"""Most envelopes handed to an independent detector's column hook at once (the rest of a longer run in
further calls): what is read ahead stays small (a whole record of 500 envelopes held ahead costs more in the
collector's passes than the calls it saves)."""
RUN_SCAN = 512
"""Most events read ahead for one such run (the other ranks' envelopes in between included)."""
_NAME: Final = itemgetter(0)
_DIAGNOSIS_NAMES: Final = frozenset(diagnosis.MEMORY_METRICS + diagnosis.LR_METRICS)
_NOTABLE_KINDS: Final = ("exception", "lifecycle", "log")
"""Kinds of events remembered by id whatever they hold (:meth:`Pipeline._notable`)."""


def _finite_values(points: Sequence[Tuple[str, Any, float]]) -> bool:
    """Whether every value of ``points`` is finite (compiled: each point read as a tuple -- no iterator per
    point, as ``for _n, _s, v in points`` makes)."""
    for point in points:
        value = point[2]
        if value - value != 0.0:  # NaN/Inf
            return False
    return True


def _max_step(points: Sequence[Tuple[str, int, Any]]) -> int:
    """``max`` of the steps of ``points`` (not empty), without the builtin's argument parsing and a map."""
    top = points[0][1]
    for point in points:
        step = point[1]
        if step > top:
            top = step
    return top


def _asking(detector: Detector, rank: RankState, names: FrozenSet[str], settings: DetectionSettings
            ) -> Tuple[Detector, Optional[bool]]:
    """How a route calls ``detector`` on a batch of point names ``names``: ask False (called without asking:
    a ``names_only`` detector that said yes, or one whose :meth:`~.detectors.base.Detector.wants_names`
    said yes), True (:meth:`~.detectors.base.Detector.wants` asked per batch), None (never called: the
    names alone said no)."""
    if detector.names_only:
        return detector, False if detector.wants(rank, names, settings) else None
    decided = detector.wants_names(names, settings)
    return detector, True if decided is None else False if decided else None


def _parse(raw: Any) -> ReadEnvelope:
    """Read the envelope fields the pipeline uses; ValueError/TypeError when it cannot."""
    if not isinstance(raw, (dict, Mapping)):
        raise TypeError(f"an envelope must be an object, got {type(raw).__name__}")
    kind, body = payload(raw)
    if kind is None:
        raise ValueError("envelope without a payload")
    get = raw.get
    run_id = _text(get("run_id"))
    if not run_id:
        raise ValueError("envelope without a run_id")
    world = _integer(get("world_size"), 1)
    return ReadEnvelope(raw, kind, body, _text(get("event_id")), _text(get("project")), run_id,
                        _integer(get("rank"), 0), _integer(get("step"), 0),
                        _integer(get("time_unix_nano"), 0), _text(get("host")), _integer(get("pid"), 0),
                        world if world > 1 else 1, _text(get("run_name")), _text(get("trace_id")))


_HOOKS = {"memory": "on_memory", "heartbeat": "on_heartbeat", "exception": "on_exception",
          "lifecycle": "on_exit", "log": "on_log"}
_HOOKED: Dict[type, FrozenSet[str]] = {}


def _event_hooks(detector: Detector) -> FrozenSet[str]:
    """The kinds of non-metric events whose hook ``detector`` implements (overrides)."""
    cls = type(detector)
    kinds = _HOOKED.get(cls)
    if kinds is None:
        kinds = _HOOKED[cls] = frozenset(k for k, hook in _HOOKS.items()
                                         if getattr(cls, hook) is not getattr(Detector, hook))
    return kinds


def _read(raw: Any, given: Optional[Sequence[Any]]) -> Tuple[ReadEnvelope, Sequence[Any]]:
    """:func:`_parse` and the event's metric points (``given``, else read from its payload); an envelope
    already read (a :class:`ReadEnvelope`) as it is."""
    ev = raw if type(raw) is ReadEnvelope else _parse(raw)
    if ev.kind != "metrics":
        return ev, []
    return ev, batch_points(ev.body, ev.step) if given is None else given


def _text(value: Any) -> str:
    """:func:`~trainguard_engine.extract.as_str`, a str first (every field of every event goes through)."""
    return value if type(value) is str else as_str(value)


def _integer(value: Any, default: int) -> int:
    """:func:`~trainguard_engine.extract.as_int`, an int first."""
    return value if type(value) is int else as_int(value, default)


def _digest(data: Mapping[str, Any]) -> str:
    """A short digest of a record's dict; ValueError when it holds a non-finite float."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str, allow_nan=False)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=10).hexdigest()


def _error_text(exc: BaseException) -> str:
    """``Type: message (at file:line in function)`` of an exception, bounded."""
    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        where = f" (at {last.filename.rsplit('/', 1)[-1]}:{last.lineno} in {last.name})"
    return f"{type(exc).__name__}: {exc}{where}"[:QUARANTINE_REASON_CHARS]


class Pipeline:
    """Per-run state, per-(project, fingerprint) clusters, the detectors and the incident lifecycle.

    ``settings`` apply to every project without an entry in ``project_settings`` (project name →
    settings, e.g. built with :meth:`DetectionSettings.from_overrides`). Not thread-safe: one pipeline per
    key range, called by one thread (as Flink's keyed operators and the embedded runtime do).
    """

    def __init__(self, settings: Optional[DetectionSettings] = None,
                 project_settings: Optional[Mapping[str, DetectionSettings]] = None) -> None:
        self.settings = settings or DetectionSettings()
        self.project_settings: Dict[str, DetectionSettings] = dict(project_settings or {})
        self.counters: Dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._runs: Dict[str, RunState] = {}
        self._clusters: Dict[str, ClusterState] = {}
        self._evicted = EvictedRuns()   # run key -> when evicted (ns), bounded, shared fairly (H48)
        self._dirty_runs: Dict[str, None] = {}
        self._dirty_clusters: Dict[str, None] = {}
        # incremental snapshots (changed_parts / parts_saved): what changed since the last saved parts,
        # what those parts held, and each run's / cluster's creation order (kept across restores)
        self._unsaved_runs: Dict[str, None] = {}
        self._unsaved_clusters: Dict[str, None] = {}
        self._saved_runs: Dict[str, None] = {}
        self._saved_clusters: Dict[str, None] = {}
        self._run_seq: Dict[str, int] = {}
        self._cluster_seq: Dict[str, int] = {}
        self._next_seq = 0
        self._unreadable_parts: List[str] = []  # stored parts restore_parts could not read: deleted next
        # a run part encodes only the ranks touched since its last encode (issue 20): each rank's bytes as
        # of then, and which ranks were touched since (None: all of them -- anything run-wide)
        self._rank_bytes: Dict[str, Dict[int, bytes]] = {}
        self._touched_ranks: Dict[str, Optional[Set[int]]] = {}
        self._ranks_wide = False  # set by a fold that may have written other ranks than the event's
        #: runs quarantined since the runtime last took the list (see :meth:`take_quarantined`)
        self.quarantined: List[Quarantined] = []
        self._held = PipelineOutput()  # records of quarantined runs, out with the next output
        self._index = ProjectIndex()  # per-project orders, counts and sizes for the quotas
        self.next_timer_ns = 0
        self._applied = 0  # findings applied so far (tells _correlate whether anything was folded in)
        # id(settings) -> (those settings, point names -> _Route), for the registry _routes_of (holding the
        # settings object keeps its id from being reused by another while remembered)
        self._routes: Dict[int, Tuple[DetectionSettings, Dict[Tuple[str, ...], _Route]]] = {}
        self._routes_of: Tuple[Detector, ...] = DETECTORS
        # the column hook (detectors/base.py), within one process() call: the events, their given points,
        # the index of the event being folded, envelopes already read ahead (index -> (event, points)), and
        # per independent detector the run of envelopes it judged ahead (see _from_run)
        self._events: Sequence[Any] = ()
        self._given: Optional[Sequence[Optional[Sequence[Any]]]] = None
        self._at = -1
        self._parsed: Dict[int, Tuple[ReadEnvelope, Sequence[Any]]] = {}
        self._routed: Dict[int, _Route] = {}  # envelopes put in a run ahead: their route (and not notable)
        self._ahead: Dict[Tuple[Detector, int], _Ahead] = {}
        """When :meth:`advance` next has something to decide (the earliest stall deadline of a live rank,
        as of the last ``advance``; 0: none). Runtimes call ``advance`` at it (besides their regular tick):
        progress after it only moves deadlines later, so an early call is harmless. Not snapshotted."""

    def settings_for(self, project: str) -> DetectionSettings:
        """The settings that apply to ``project``."""
        return self.project_settings.get(project, self.settings)

    # --- inputs -----------------------------------------------------------------------------
    def process(self, events: Sequence[Union[Mapping[str, Any], ReadEnvelope]],
                points: Optional[Sequence[Optional[Sequence[Any]]]] = None) -> PipelineOutput:
        """Fold ``events`` (envelope dicts, arrival order) into the state; every record that changed.

        An event may be a :class:`ReadEnvelope` instead of its dict (read by the runtime already).
        ``points``, when given, holds for each event its metric points as
        :func:`~trainguard_engine.extract.metric_points` reads them (None: read them here) -- a runtime
        that already read them for its metric store passes them so they are read once."""
        count = len(events) if points is None else min(len(events), len(points))
        self._events, self._given = events, points
        try:
            for at in range(count):
                self._at = at
                index: Any = at  # (boxed once for both reads)
                self._process_one(events[index], None if points is None else points[index])
        finally:  # a run of envelopes never spans two calls (see detectors/base.py)
            self._events, self._given, self._at = (), None, -1
            self._ahead.clear()
            self._parsed.clear()
            self._routed.clear()
        return self._flush()

    def advance(self, now_ns: int) -> PipelineOutput:
        """Processing-time timers at ``now_ns`` (the runtime's clock): correlation's waits (a silent
        rank, a lagging rank), live ranks whose stall deadline passed become stalled (see
        :attr:`next_timer_ns`), runs silent for longer than ``lost_after_s`` become lost; runs past their TTL
        are evicted (no output: their records stay in the stores). Returns every record that changed."""
        next_timer = 0
        for run in list(self._runs.values()):
            if self._runs.get(run.key) is not run:
                continue  # evicted meanwhile (another run of its project needed the room)
            before = len(run.incidents)
            try:
                next_timer = self._advance_run(run, now_ns, next_timer)
            except Exception as exc:  # a bug met by this run's state stops this run only
                self._index.add_incidents(run.project, len(run.incidents) - before)
                self._quarantine(run.key, f"timers at {now_ns} raised {_error_text(exc)}")
                continue
            self._incidents_changed(run, len(run.incidents) - before, now_ns)
        self._evict(now_ns)
        self.next_timer_ns = next_timer
        return self._flush()

    def _advance_run(self, run: RunState, now_ns: int, next_timer: int) -> int:
        """:meth:`advance` for one run; returns ``next_timer`` lowered to the run's earliest deadline."""
        settings = self.settings_for(run.project)
        if run.incidents:
            self._unsaved_runs[run.key] = None  # correlation's waits keep notes on the incidents
            self._touched_ranks[run.key] = None  # (and may mark silent ranks lost)
            self._correlate(run, now_ns, settings)
        if run.key not in self._touched_ranks or self._touched_ranks[run.key] is not None:
            for rank in run.ranks.values():  # a stall check reads and may write a rank whose deadline passed
                deadline = progress.stall_deadline_ns(run, rank, settings)
                if deadline and now_ns >= deadline:
                    self._touched_ranks[run.key] = None
                    break
        for rank, stall in progress.check_stalled(run, now_ns, settings):
            self._apply_stall(run, rank, stall, settings)
            self._mark(run)
        for rank in run.ranks.values():
            deadline = progress.stall_deadline_ns(run, rank, settings)
            if deadline and (not next_timer or deadline < next_timer):
                next_timer = deadline
        findings = progress.check_lost(run, now_ns, settings)
        if not findings:
            return next_timer
        for finding in findings:
            self._apply(run, finding, settings)
        run.lost, run.lost_since_ns = True, run.last_event_ns
        run.next_episode("lost")
        self._mark(run)
        return next_timer

    def _process_one(self, raw: Any, given: Optional[Sequence[Any]]) -> None:
        self.counters["events"] += 1
        applied_before = self._applied
        read = self._parsed.pop(self._at, None) if self._parsed else None
        if read is not None:
            ev, points = read
        elif given is not None and type(raw) is ReadEnvelope and raw.kind == "metrics":
            ev, points = raw, given  # (_read, inline: an envelope the runtime read, with its points)
        else:
            try:
                ev, points = _read(raw, given)
            except (TypeError, ValueError, AttributeError):
                self.counters["malformed"] += 1
                return
        key = f"{ev.project}\x00{ev.run_id}"  # (run_key, inline)
        if key in self._evicted.when:  # (EvictedRuns.__contains__, inline)
            self.counters["late"] += 1
            return
        held = self._runs.get(key)
        before = len(held.incidents) if held is not None else 0
        try:
            self._fold(ev, key, points, applied_before, held)
        except Exception as exc:  # a bug met by this run's data stops this run only
            run = self._runs.get(key)
            if run is not None:
                self._index.add_incidents(run.project, len(run.incidents) - before)
            self._quarantine(key, f"event {ev.event_id or '(no id)'} ({ev.kind}, step {ev.step}) raised "
                                  f"{_error_text(exc)}")
            return
        run = self._runs[key]
        if len(run.incidents) != before:
            self._incidents_changed(run, len(run.incidents) - before, ev.time_ns)

    def _fold(self, ev: ReadEnvelope, key: str, points: Sequence[Any], applied_before: int,
              run: Optional[RunState] = None) -> None:
        """Fold one parsed event into its run's state (``_process_one`` after the envelope was read; ``run``:
        the run of ``key`` when it is held already)."""
        project_settings = self.project_settings  # (settings_for, inline: once per event)
        settings = project_settings.get(ev.project, self.settings) if project_settings else self.settings
        if run is None:
            run = self._run(ev, key)
        self._unsaved_runs[key] = None
        routed = self._routed.pop(self._at, None) if self._routed else None  # (not notable: see _run_ahead)
        kind, event_id, time_ns = ev.kind, ev.event_id, ev.time_ns  # (read once: ``ev``'s class is pure)
        if event_id and routed is None:
            if kind == "metrics":  # (_notable, inline)
                body = ev.body
                notable = (type(body) not in PLAIN_BODIES and bool(body.get("alert"))) or \
                    not _finite_values(points)
            else:
                notable = kind in _NOTABLE_KINDS
            if notable and not run.remember(event_id, settings):
                self.counters["duplicates"] += 1
                return
        rank = run.ranks.get(ev.rank)
        if rank is None:
            rank = run.rank_state(ev.rank, settings)
            if rank is None:
                self.counters["ranks_dropped"] += 1
                return
        first = run.first_rank()  # where run-wide detector state lives (straggler's)
        judged = _judged(first.detectors)
        wide = run.lost or bool(run.incidents)  # on_alive, correlation: run-wide
        self._ranks_wide = False
        host, pid, world_size = ev.host, ev.pid, ev.world_size
        if host:  # (rank.touch, inline)
            rank.host = host
        if pid:
            rank.pid = pid
        if rank.first_ns == 0 or 0 < time_ns < rank.first_ns:
            rank.first_ns = time_ns
        if time_ns > rank.last_ns:
            rank.last_ns = time_ns
        if world_size > run.world_size:  # (written only when they change: the same values as max / or)
            run.world_size = world_size
        if not run.run_name:
            run.run_name = ev.run_name
        if not run.trace_id:
            run.trace_id = ev.trace_id
        if time_ns:
            if not run.first_ns or time_ns < run.first_ns:
                run.first_ns = time_ns
            if time_ns > run.last_event_ns:  # newer: the run becomes its project's most recently active
                run.last_event_ns = time_ns  # (a replayed or late event changes no order: idempotent)
                index = self._index
                mine = index.runs.get(run.project)
                if mine and next(reversed(mine)) == key:  # already its project's latest (touch_run, inline)
                    index.touched += 1
                    run.touched = index.touched
                else:
                    index.touch_run(run, key)
        if run.lost:  # (else nothing to say)
            progress.on_alive(run, rank, time_ns, settings)
        if kind == "metrics":
            self._on_metrics(run, rank, ev, points, settings, self._at, routed)
        elif kind == "heartbeat":
            self._on_heartbeat(run, rank, ev, settings)
        elif kind == "exception":
            self._on_exception(run, rank, ev, settings)
        elif kind == "lifecycle":
            self._on_lifecycle(run, rank, ev, settings)
        elif kind == "log":  # error text printed by the job (process), an agent's hang report (progress)
            event = _info(ev, _step_of(ev, rank))
            for detector in DETECTORS:
                self._apply_all(run, rank, detector.on_log(run, rank, event, settings), settings)
        elif kind == "memory":
            diagnosis.observe_memory(rank, ev.body)
            batch = new_batch((), ev.step, time_ns, event_id)
            for detector in DETECTORS:
                self._apply_all(run, rank, detector.on_memory(run, rank, ev.body, batch, settings), settings)
        if run.incidents:
            self._correlate(run, time_ns, settings, folded=self._applied != applied_before)
        self._dirty_runs[key] = None  # _mark, inline (_unsaved_runs: set on entry)
        # which ranks this event may have written: its own and the first (run-wide detector state), unless
        # anything run-wide ran -- a finding applied (incidents, diagnosis), correlation, a lost run back,
        # shards combined, a step judged across ranks (the straggler detector writes every rank's pairs)
        touched = self._touched_ranks.get(key, _NO_RANKS)
        if touched is None:
            return  # every rank already
        if wide or run.incidents or self._ranks_wide or self._applied != applied_before or \
                _judged(first.detectors) != judged:
            self._touched_ranks[key] = None
        else:
            if touched is _NO_RANKS:
                touched = self._touched_ranks[key] = set()
            touched.add(rank.rank)
            touched.add(first.rank)

    @staticmethod
    def _notable(ev: ReadEnvelope, points: Sequence[Any]) -> bool:
        """Events whose effect is not idempotent by construction: remembered by id to drop replays."""
        if ev.kind in _NOTABLE_KINDS:
            return True
        if ev.kind == "metrics":
            if type(ev.body) not in PLAIN_BODIES and ev.body.get("alert"):
                return True
            return not _finite_values(points)
        return False

    # --- handlers ---------------------------------------------------------------------------
    def _route(self, rank: RankState, points: Sequence[Any], settings: DetectionSettings) -> _Route:
        """The :class:`_Route` of ``points``' list of names under ``settings`` (made on first sight, then
        remembered)."""
        if self._routes_of is not DETECTORS:  # the registry was swapped (tests do): start afresh
            self._routes.clear()
            self._routes_of = DETECTORS
        held = self._routes.get(id(settings))
        if held is None or held[0] is not settings:
            if len(self._routes) >= ROUTES_MAX:
                self._routes.clear()
            held = self._routes[id(settings)] = (settings, {})
        routes = held[1]
        key = tuple(map(_NAME, points))
        route = routes.get(key)
        if route is None:
            names = frozenset(key)
            called = tuple((d, ask) for d, ask in (_asking(d, rank, names, settings) for d in DETECTORS)
                           if ask is not None)
            route = _Route(names, any(n.startswith(shards.SHARD_GLOBAL) for n in names),
                           tuple(i for i, n in enumerate(key) if n in _DIAGNOSIS_NAMES), called,
                           tuple(d for d, _ask in called if d.independent),
                           tuple(map(settings.keeps_history, key)))
            if len(routes) >= ROUTES_MAX:
                routes.clear()
            routes[key] = route
        return route

    def _on_metrics(self, run: RunState, rank: RankState, ev: ReadEnvelope, points: Sequence[Any],
                    settings: DetectionSettings, at: int, route: Optional[_Route] = None) -> None:
        """A metric envelope (``at``: its index in the events of this ``process`` call; -1: a step's
        combined shard norms, not an envelope; ``route``: its route when already known)."""
        envelope: Any = ev  # (the batch's step and time: the envelope's own objects, not boxed again)
        time_at = envelope.time_ns
        time_ns: int = time_at
        if route is None:  # (_route, inline on a hit: the routes of ``settings``, held and current)
            held = self._routes.get(id(settings)) if self._routes_of is DETECTORS else None
            if held is not None and held[0] is settings:
                route = held[1].get(tuple(map(_NAME, points)))
            if route is None:
                route = self._route(rank, points, settings)
        if points and rank.observe_step(_max_step(points), time_ns) and run.incidents:
            progress.on_progress(run, rank, time_ns, settings)  # (it reads an open stall incident only)
        rank.observe_points(points, route.keep, time_ns, settings)
        if route.diagnosis:  # (it reads those points only)
            diagnosis.observe(rank, points, route.diagnosis)
        body = ev.body  # (a plain body holds no recent context: PLAIN_BODIES)
        if type(body) not in PLAIN_BODIES and body.get("recent"):
            keeps, observe = settings.keeps_history, rank.observe_point
            for name, step, value in recent_points(ev.raw):
                if keeps(name):
                    observe(name, step, value, time_ns, settings, context=True)
        batch = new_batch(points, envelope.step, time_at, ev.event_id)
        names = route.names
        columns = route.columns if at >= 0 and not route.sharded else ()
        for detector, ask in route.detectors:  # the registry's order (see detectors/registry.py)
            if columns and detector in columns:
                found = self._from_run(detector, run, rank, ev, points, batch, settings, at)
            elif not ask or detector.wants_rank(rank, names, settings):
                found = detector.on_metrics(run, rank, batch, settings)
            else:
                continue
            if found:
                for finding in found:
                    self._apply(run, finding, settings)
        if route.sharded:
            self._ranks_wide = True  # shards.fold reads and clears every rank's shares
            combined = shards.fold(run, rank.rank, points)
            if combined:  # a step every rank reported its share of: the full gradients' norms
                target = run.ranks[min(run.ranks)]
                self._on_metrics(run, target, replace(ev, rank=target.rank, event_id="", body={}, raw={}),
                                 combined, settings, -1)

    def _from_run(self, detector: Detector, run: RunState, rank: RankState, ev: ReadEnvelope,
                  points: Sequence[Any], batch: MetricBatch, settings: DetectionSettings,
                  at: int) -> Sequence[Finding]:
        """An independent detector's findings on envelope ``at`` of ``rank`` (the column hook,
        detectors/base.py): those it found ahead when ``at`` is the next envelope of the run of this rank
        it was handed; else it is handed the run starting here (:meth:`_run_ahead`), this envelope's
        findings are returned and the others kept."""
        slot = (detector, id(rank))
        held = self._ahead.get(slot)
        if held is not None and held.rank is rank and at < held.end:
            if held.indices[held.pos] != at:  # (cannot happen: see _run_ahead)
                raise RuntimeError(f"{detector!r}: envelope {held.indices[held.pos]} of its run was skipped")
            k = held.pos
            if k < len(held.found.findings):
                held.pos += 1
                return held.found.findings[k]
            del self._ahead[slot]  # the envelope its hook raised on
            raise held.found.error or RuntimeError(f"{detector!r}: no findings for envelope {at}")
        indices = [at]
        batches = [batch]
        end = at + 1
        if not self._notable(ev, points):
            end = self._run_ahead(detector, rank, ev, settings, at, indices, batches)
        if len(batches) == 1:
            self._ahead.pop(slot, None)
            return detector.on_metrics(run, rank, batch, settings)
        found = detector.on_metric_run(run, rank, MetricRun(batches), settings)
        if not found.findings:
            assert found.error is not None
            raise found.error
        self._ahead[slot] = _Ahead(rank, indices, end, 1, found)
        return found.findings[0]

    def _run_ahead(self, detector: Detector, rank: RankState, ev: ReadEnvelope, settings: DetectionSettings,
                   at: int, indices: List[int], batches: List[MetricBatch]) -> int:
        """Add to ``indices`` and ``batches`` the metric envelopes after ``at`` that continue ``rank``'s run
        for ``detector``; the index where the run stops. Read ahead, at most RUN_SCAN events and RUN_MAX
        envelopes: the envelopes of ``rank`` routed to ``detector`` until one of that rank that could
        change what the detector reads or whether it is called -- an event of a kind whose hook it
        implements (a ``memory`` event for the memory detector), an envelope of it with a non-finite
        value or an alert (a replay of those is dropped by id), an event of another host (the rank's
        host is read) -- or any envelope of the run carrying a shard's norm (combined into the first
        rank's), or an event that cannot be read. The other events in between (other ranks and runs, this
        rank's metrics the detector is not called for) leave the detector's state alone."""
        events, given, parsed, routed = self._events, self._given, self._parsed, self._routed
        count = len(events) if given is None else min(len(events), len(given))
        count = min(count, at + RUN_SCAN)
        # the routes of ``settings`` (made by _route for envelope ``at``): looked up here, _route on a miss
        held = self._routes.get(id(settings)) if self._routes_of is DETECTORS else None
        routes = held[1] if held is not None and held[0] is settings else None
        run_id, project, host = ev.run_id, ev.project, rank.host
        ev_rank = ev.rank
        j = at + 1
        while j < count and len(batches) < RUN_MAX:
            index: Any = j  # (boxed once: the key and position of every read below)
            read = parsed.get(index)
            if read is None:
                raw = events[index]
                points = None if given is None else given[index]
                if points is not None and type(raw) is ReadEnvelope and raw.kind == "metrics":
                    read = (raw, points)  # (_read, inline: an envelope the runtime read, with its points)
                else:
                    try:
                        read = _read(raw, points)
                    except Exception:  # malformed (or worse): that event says so itself when its turn comes
                        return j
                parsed[index] = read
            nxt, points = read
            if nxt.run_id != run_id or nxt.project != project:
                j += 1
                continue  # another run's
            if nxt.kind != "metrics":
                if nxt.rank == ev_rank and (nxt.kind in _event_hooks(detector) or
                                            (nxt.host and nxt.host != host)):
                    return j
                j += 1
                continue
            try:
                route = routes.get(tuple(map(_NAME, points))) if routes is not None else None
                if route is None:
                    route = self._route(rank, points, settings)
            except Exception:  # a detector's wants() that raises: at that envelope's turn, as before
                return j
            if route.sharded:
                return j
            nxt_rank = nxt.rank
            if nxt_rank != ev_rank or detector not in route.columns:
                if nxt_rank == ev_rank and nxt.host and nxt.host != host:
                    return j
                j += 1
                continue
            if nxt.host and nxt.host != host:
                return j
            body = nxt.body  # (_notable, inline: a metric envelope)
            if (type(body) not in PLAIN_BODIES and body.get("alert")) or not _finite_values(points):
                return j
            indices.append(index)
            routed[index] = route
            nxt_any: Any = nxt  # (its step and time as objects: see _on_metrics)
            batches.append(new_batch(points, nxt_any.step, nxt_any.time_ns, nxt.event_id))
            j += 1
        return j

    def _on_heartbeat(self, run: RunState, rank: RankState, ev: ReadEnvelope,
                      settings: DetectionSettings) -> None:
        if ev.time_ns <= rank.last_hb_ns:
            return  # a replayed or reordered heartbeat says nothing new
        before = rank.progress_ns
        body = ev.body
        rank.observe_heartbeat(as_int(body.get("last_step"), 0),
                               as_int(body.get("last_step_time_unix_nano"), 0),
                               as_float(body.get("step_time_ewma_s"), 0.0), ev.time_ns)
        if rank.progress_ns > before:
            progress.on_progress(run, rank, ev.time_ns, settings)
        event = _info(ev, ev.step)
        for detector in DETECTORS:
            self._apply_all(run, rank, detector.on_heartbeat(run, rank, event, settings), settings)

    def _on_exception(self, run: RunState, rank: RankState, ev: ReadEnvelope,
                      settings: DetectionSettings) -> None:
        key = cluster_key(ev.project, clusters_mod.identify(ev.body)[0])
        if key not in self._clusters:
            self._room_for_cluster(ev.project)
        cluster, evicted = clusters_mod.observe(self._clusters, ev.project, ev.run_id, ev.rank, ev.host,
                                                ev.event_id, ev.time_ns, ev.body, self.settings)
        self.counters["clusters_evicted"] += evicted  # 0: _room_for_cluster made room within the project
        self._index.touch_cluster(ev.project, key, cluster)
        self._dirty_clusters[key] = None
        self._unsaved_clusters[key] = None
        event = _info(ev, _step_of(ev, rank))
        for detector in DETECTORS:
            self._apply_all(run, rank, detector.on_exception(run, rank, event, cluster.record.fingerprint,
                                                             settings), settings)

    def _on_lifecycle(self, run: RunState, rank: RankState, ev: ReadEnvelope,
                      settings: DetectionSettings) -> None:
        phase = ev.body.get("phase")
        if phase in _PHASE_START:
            rank.started_ns = min(rank.started_ns, ev.time_ns) if rank.started_ns else ev.time_ns
            run.started_ns = min(run.started_ns, ev.time_ns) if run.started_ns else ev.time_ns
            diagnosis.observe_start(rank, ev.body)
            tags = ev.body.get("tags")
            if isinstance(tags, Mapping):
                for k, v in tags.items():
                    if ev.rank == 0 or k not in run.tags:
                        run.tags[str(k)] = as_str(v)
        elif phase in _PHASE_EXIT:
            rank.exited = True
            rank.exit_code = as_int(ev.body.get("exit_code"), 0)
            rank.exit_signal = as_int(ev.body.get("signal"), 0)
            rank.exit_reason = as_str(ev.body.get("reason"))
            rank.exit_ns = ev.time_ns
            event = _info(ev, ev.step)
            for detector in DETECTORS:  # progress (the stall an exit ends) before process (its verdict)
                self._apply_all(run, rank, detector.on_exit(run, rank, event, settings), settings)
            progress.on_progress(run, rank, ev.time_ns, settings)

    # --- bookkeeping --------------------------------------------------------------------------
    def _apply_all(self, run: RunState, rank: RankState, findings: Sequence[Finding],
                   settings: DetectionSettings) -> None:
        """Apply an event hook's findings; a stall's also records that the rank is in it."""
        for finding in findings:
            self._apply_stall(run, rank, finding, settings)

    def _apply_stall(self, run: RunState, rank: RankState, finding: Optional[Finding],
                     settings: DetectionSettings) -> None:
        """Apply a progress/stalled finding of ``rank`` (if any) and record that the rank is in the stall."""
        if finding is None:
            return
        st = self._apply(run, finding, settings)
        if st is not None and st.key.startswith(progress.STALL_PREFIX):
            progress.joined_stall(run, rank, st.key)

    def _apply(self, run: RunState, finding: Finding, settings: DetectionSettings) -> Optional[IncidentState]:
        self._applied += 1
        st = incident_mod.apply(run, correlate.route(run, finding, settings), settings)
        if st is None:
            self.counters["incidents_suppressed"] += 1
        else:
            # event-driven (never at flush): the record is then the same however events are batched
            diagnosis.enrich(run, st, settings)
        return st

    def _correlate(self, run: RunState, now_ns: int, settings: DetectionSettings,
                   folded: bool = True) -> None:
        """Cross-rank correlation at ``now_ns`` (see :mod:`.correlate`): consequences folded into their
        cause, silent ranks named as the lost rank of their peers' failures. ``folded``: a finding was
        applied since the last call -- only then can a consequence have a new cause or a shared NaN a new
        lead (they are recomputed over the run's ranks: not on every metric event of a run with an
        incident); the waits (lagging, silent ranks) are checked every time, as time passes, while an
        incident they read is open (correlate.waits_open: without one they find and note nothing)."""
        changed = False
        if folded:
            for finding in correlate.check_desync(run, settings):
                self._apply(run, finding, settings)
                changed = True
        waits = correlate.waits_open(run)
        if waits:
            for finding in correlate.check_lagging(run, now_ns, settings):
                self._apply(run, finding, settings)
                changed = folded = True
        if folded:
            for st in correlate.explain(run, settings) + correlate.pin_numeric_lead(run, settings):
                diagnosis.enrich(run, st, settings)
                changed = True
            waits = correlate.waits_open(run)  # findings applied, causes folded: kinds and states moved
        if waits:
            for finding in correlate.check_silent_peers(run, now_ns, settings):
                self._apply(run, finding, settings)
                changed = True
        if changed:
            self._mark(run)

    def _mark(self, run: RunState) -> None:
        self._dirty_runs[run.key] = None
        self._unsaved_runs[run.key] = None
        self._touched_ranks[run.key] = None  # (from timers and correlation: any rank may have changed)

    def _run(self, ev: ReadEnvelope, key: str) -> RunState:
        run = self._runs.get(key)
        if run is None:
            self._room_for_run(ev.project, ev.time_ns)
            run = self._runs[key] = RunState(project=ev.project, run_id=ev.run_id)
            self._index.touch_run(run)
        return run

    # --- quotas (see .quotas) -----------------------------------------------------------------------
    @property
    def quota_evictions(self) -> Dict[Tuple[str, str], int]:
        """``(project, quota) -> runs or clusters evicted`` because the project hit that quota (``runs``,
        ``clusters``, ``incidents``, ``state_bytes``) or held the most when the pipeline was full. Since
        this pipeline was created or restored (not snapshotted); read-only."""
        return self._index.hits

    def _room_for_run(self, project: str, now_ns: int) -> None:
        """Before ``project`` gets a new run: evict one of its own when it holds project_max_runs, or one
        of the largest project's when the pipeline holds max_runs."""
        index = self._index
        if index.run_count(project) >= self.settings_for(project).project_max_runs:
            over = project
        elif len(self._runs) >= self.settings.max_runs:
            over = index.largest(index.runs)
        else:
            return
        victim = index.victim(over, self._runs)
        if victim is not None:
            index.hit(over, "runs")
            self._drop_run(victim, now_ns)

    def _room_for_cluster(self, project: str) -> None:
        """Before ``project`` gets a new cluster: evict its least recently seen when it holds
        project_max_clusters, or the largest project's when the pipeline holds max_clusters."""
        index = self._index
        if len(index.clusters.get(project, ())) >= self.settings_for(project).project_max_clusters:
            over = project
        elif len(self._clusters) >= self.settings.max_clusters:
            over = index.largest(index.clusters)
        else:
            return
        victim = next(iter(index.clusters[over]))
        index.remove_cluster(over, victim)
        index.hit(over, "clusters")
        self._clusters.pop(victim, None)
        self._dirty_clusters.pop(victim, None)
        self.counters["clusters_evicted"] += 1

    def _incidents_changed(self, run: RunState, delta: int, now_ns: int) -> None:
        """``run`` holds ``delta`` more incidents: beyond project_max_incidents, the project's least
        recently active other runs holding incidents are evicted."""
        index = self._index
        index.add_incidents(run.project, delta)
        quota = self.settings_for(run.project).project_max_incidents
        while index.incidents.get(run.project, 0) > quota:
            victim = index.victim_with_incidents(run.project, self._runs, keep=run.key)
            if victim is None:
                return  # the run alone: bounded by max_incidents_per_run
            index.hit(run.project, "incidents")
            self._drop_run(victim, now_ns)

    def _trim_state_bytes(self, now_ns: int) -> None:
        """Projects whose runs serialised beyond project_max_state_bytes at the last checkpoint lose their
        ended (then least recently active) runs until they fit."""
        index = self._index
        for project in list(index.bytes):
            quota = self.settings_for(project).project_max_state_bytes
            while index.bytes.get(project, 0) > quota:
                victim = index.victim(project, self._runs)
                if victim is None:
                    break
                index.hit(project, "state_bytes")
                self._drop_run(victim, now_ns)

    def _drop_run(self, key: str, now_ns: int, counter: str = "runs_evicted") -> None:
        self._index.remove_run(self._runs.pop(key))
        self._dirty_runs.pop(key, None)
        self._rank_bytes.pop(key, None)
        self._touched_ranks.pop(key, None)
        if self.settings.evicted_runs_remembered:
            self._evicted.put(key, now_ns, self.settings.evicted_runs_remembered)
        self.counters[counter] += 1

    def _quarantine(self, key: str, reason: str) -> None:
        """Drop run ``key`` for good (see the module docstring): what of its records changed goes out with
        the next output when they can still be built; its later events are dropped; listed for the
        runtime."""
        run = self._runs.get(key)
        if run is None:
            return
        if key in self._dirty_runs:
            try:
                self._flush_run(run, self._held)
            except Exception:  # a state too broken to render: the stores keep what they had
                pass
        self._drop_run(key, run.last_event_ns, "runs_quarantined")
        self._unsaved_runs.pop(key, None)
        if len(self.quarantined) < QUARANTINE_LIST_MAX:
            self.quarantined.append(Quarantined(run.project, run.run_id, reason))

    def take_quarantined(self) -> List[Quarantined]:
        """The runs quarantined since the last call (for the runtime to log), oldest first."""
        out, self.quarantined = self.quarantined, []
        return out

    def _evict(self, now_ns: int) -> None:
        for key, run in list(self._runs.items()):
            settings = self.settings_for(run.project)
            ttl = settings.ended_run_ttl_s if run.ended() else settings.idle_run_ttl_s
            if run.last_event_ns and (now_ns - run.last_event_ns) / 1e9 > ttl:
                self._drop_run(key, now_ns)
        self._trim_state_bytes(now_ns)

    # --- outputs ------------------------------------------------------------------------------
    def _flush(self) -> PipelineOutput:
        out, self._held = self._held, PipelineOutput()
        for key in sorted(self._dirty_runs):
            run = self._runs.get(key)
            if run is None:
                continue
            try:
                self._flush_run(run, out)
            except Exception as exc:  # a state that cannot be rendered stops its run only
                self._quarantine(key, f"building its records raised {_error_text(exc)}")
        for key in sorted(self._dirty_clusters):
            cluster = self._clusters.get(key)
            if cluster is None:
                continue
            cluster.dirty = False
            raw = cluster.record.to_dict()
            data, digest = self._finite(raw)
            if data is not raw:  # kept spelled out in the state too: a snapshot must serialise
                cluster.record = Cluster.from_dict(finite_copy(data))
            if digest != cluster.emitted:
                cluster.emitted = digest
                out.clusters.append(Cluster.from_dict(data))
        self._dirty_runs.clear()
        self._dirty_clusters.clear()
        out.incidents.sort(key=lambda i: (i.project, i.run_id, i.first_ns, i.incident_id))
        return out

    def _flush_run(self, run: RunState, out: PipelineOutput) -> None:
        """Add ``run``'s record and its changed incidents to ``out`` unless they are what was emitted."""
        record = run_record(run)
        raw = record.to_dict()
        data, digest = self._finite(raw)
        if digest != run.emitted:
            run.emitted = digest
            out.runs.append(record if data is raw else RunRecord.from_dict(data))
        for st in run.incidents.values():
            if not st.dirty:
                continue
            st.dirty = False
            raw = st.record.to_dict()
            data, digest = self._finite(raw)
            if data is not raw:  # kept spelled out in the state too: a snapshot must serialise
                st.record = Incident.from_dict(finite_copy(data))
            if digest != st.emitted:
                st.emitted = digest
                out.incidents.append(Incident.from_dict(data))

    def _finite(self, data: Dict[str, Any]) -> Tuple[Dict[str, Any], str]:
        """``(data, digest)`` of a record's dict without a non-finite number (the usual case: no copy);
        else ``(a copy with them spelled out, its digest)``, counted in ``nonfinite_encoded``."""
        try:
            return data, _digest(data)
        except ValueError:
            self.counters["nonfinite_encoded"] += 1
            clean: Dict[str, Any] = finite_copy(data)
            return clean, _digest(clean)

    # --- inspection ---------------------------------------------------------------------------
    def runs(self) -> List[RunRecord]:
        """The current record of every run in state, by (project, run_id)."""
        return [run_record(self._runs[k]) for k in sorted(self._runs)]

    def incidents(self) -> List[Incident]:
        """The current record of every incident in state."""
        out = [Incident.from_dict(st.record.to_dict()) for k in sorted(self._runs)
               for st in self._runs[k].incidents.values()]
        out.sort(key=lambda i: (i.project, i.run_id, i.first_ns, i.incident_id))
        return out

    def clusters(self) -> List[Cluster]:
        """The current record of every cluster in state, by (project, fingerprint)."""
        return [Cluster.from_dict(self._clusters[k].record.to_dict()) for k in sorted(self._clusters)]

    def run_state(self, project: str, run_id: str) -> Optional[RunState]:
        """The live state of a run (for detectors' tests and debugging; do not mutate)."""
        return self._runs.get(run_key(project, run_id))

    # --- snapshots ----------------------------------------------------------------------------
    def snapshot(self) -> bytes:
        """The whole state as versioned JSON (UTF-8, ASCII-escaped). Call between process/advance calls.
        A run or cluster whose state cannot be serialised is quarantined first; the rest is saved."""
        for attempt in range(2):
            doc = {
                "format": SNAPSHOT_FORMAT, "version": SNAPSHOT_VERSION,
                "runs": [run.to_json() for run in self._runs.values()],
                "clusters": [c.to_json() for c in self._clusters.values()],
                "evicted": [[k, t] for k, t in self._evicted.items()],
                "counters": self.counters,
            }
            try:
                return _json_bytes(doc)
            except (ValueError, TypeError, RecursionError):
                if attempt:
                    raise  # not a run's nor a cluster's: a bug in the header
                for key in list(self._runs):  # find the culprits one by one (rare: no cost otherwise)
                    self._run_part(key)
                for key in list(self._clusters):
                    self._cluster_part(key)
        raise AssertionError("unreachable")  # pragma: no cover

    def _run_part(self, key: str) -> Optional[bytes]:
        """Run ``key``'s snapshot part; None (and the run quarantined) when its state cannot be serialised."""
        run = self._runs[key]
        try:
            blob = self._encode_run(key, run)
        except (ValueError, TypeError, RecursionError) as exc:
            self._quarantine(key, f"its state cannot be serialised: {_error_text(exc)}")
            return None
        self._index.size_run(run.project, key, len(blob))
        return blob

    def _encode_run(self, key: str, run: RunState) -> RunPart:
        """Run ``key``'s part, the bytes of ``_json_bytes({"seq": .., "run": run.to_json()})``: the run
        without its ranks encoded, each rank touched since the last encode (see ``_touched_ranks``) encoded,
        the others' bytes of then joined in."""
        head = _json_bytes({"seq": self._run_seq.get(key, 0), "run": run.to_json(with_ranks=False)})
        at = head.find(_EMPTY_RANKS)  # the first: the run's own (a string holds no bare quote; tags are
        if at < 0:                    # strings; incidents come after it)
            raise ValueError("a run encoded without its ranks list")  # pragma: no cover
        held = self._rank_bytes.get(key, {})
        touched = self._touched_ranks.get(key, set())
        pieces: Dict[int, bytes] = {}
        for number, rank in run.ranks.items():
            piece = held.get(number) if touched is not None and number not in touched else None
            pieces[number] = _json_bytes(rank.to_json()) if piece is None else piece
        ranks = b",".join(pieces.values())
        start = at + len(_EMPTY_RANKS) - 1  # just after the '[' of the ranks list
        blob = RunPart(b"".join((head[:start], ranks, head[start:])))
        blob.ranks_at = start - 1
        blob.ranks_end = start + len(ranks) + 1  # just after its ']'
        blob.rank_pieces = list(pieces.values())
        self._rank_bytes[key] = pieces
        self._touched_ranks.pop(key, None)
        return blob

    def _cluster_part(self, key: str) -> Optional[bytes]:
        """Cluster ``key``'s snapshot part; None (and the cluster dropped, listed as quarantined, counted as
        evicted: its record stays in the stores) when it cannot be serialised."""
        cluster = self._clusters[key]
        try:
            return _json_bytes({"seq": self._cluster_seq.get(key, 0), "cluster": cluster.to_json()})
        except (ValueError, TypeError, RecursionError) as exc:
            del self._clusters[key]
            self._index.remove_cluster(cluster.record.project, key)
            self._dirty_clusters.pop(key, None)
            self._unsaved_clusters.pop(key, None)
            self.counters["clusters_evicted"] += 1
            if len(self.quarantined) < QUARANTINE_LIST_MAX:
                self.quarantined.append(Quarantined(
                    cluster.record.project, "", f"cluster {cluster.record.fingerprint}: its state cannot be "
                    f"serialised: {_error_text(exc)}"))
            return None

    def changed_parts(self) -> Dict[str, Optional[bytes]]:
        """The state as parts to store under their keys, only those that changed since the last
        :meth:`parts_saved` (everything, the first time): ``"header"`` (counters, evicted runs),
        ``"run/<key>"`` and ``"cluster/<key>"`` as versioned JSON, ``None`` for a run or cluster that is gone
        (delete its key). Store them all in one atomic step, then call :meth:`parts_saved`;
        :meth:`restore_parts` of the stored parts equals :meth:`restore` of :meth:`snapshot`. A checkpoint
        costs what changed: a run that got no event and has no open question is not written again, and a
        run part (a :class:`RunPart`) encodes again only the ranks an event or timer may have written since
        its last encode -- the event's rank and the run's first (run-wide detector state), or every rank
        after anything run-wide (a finding, correlation, a judged step, shards, timers) -- byte for byte
        the whole encoding (tests/services/processor/test_rank_parts.py)."""
        for items, seq in ((self._runs, self._run_seq), (self._clusters, self._cluster_seq)):
            for key in items:  # creation order, kept across restores (dicts keep insertion order)
                if key not in seq:
                    seq[key] = self._next_seq
                    self._next_seq += 1
        out: Dict[str, Optional[bytes]] = {"header": b""}  # first key; written last (counters)
        for key in list(self._unsaved_runs):
            if key in self._runs:
                blob = self._run_part(key)  # None: quarantined (deleted below if it was saved before)
                if blob is not None:
                    out[_part("run/", key)] = blob
        for key in list(self._unsaved_clusters):
            if key in self._clusters:
                blob = self._cluster_part(key)
                if blob is not None:
                    out[_part("cluster/", key)] = blob
        header = {"format": SNAPSHOT_FORMAT, "version": SNAPSHOT_VERSION, "part": "header",
                  "evicted": [[k, t] for k, t in self._evicted.items()], "counters": self.counters,
                  "next_seq": self._next_seq}
        out["header"] = _json_bytes(header)
        for name in self._unreadable_parts:
            out[name] = None
        for key in self._saved_runs:
            if key not in self._runs:
                out[_part("run/", key)] = None
        for key in self._saved_clusters:
            if key not in self._clusters:
                out[_part("cluster/", key)] = None
        return out

    def parts_saved(self) -> None:
        """The parts of the last :meth:`changed_parts` are stored: start counting changes afresh."""
        self._saved_runs = dict.fromkeys(self._runs)
        self._saved_clusters = dict.fromkeys(self._clusters)
        self._unsaved_runs.clear()
        self._unsaved_clusters.clear()
        self._unreadable_parts.clear()
        self._run_seq = {k: v for k, v in self._run_seq.items() if k in self._runs}
        self._cluster_seq = {k: v for k, v in self._cluster_seq.items() if k in self._clusters}

    @classmethod
    def restore_parts(cls, parts: Mapping[str, bytes], settings: Optional[DetectionSettings] = None,
                      project_settings: Optional[Mapping[str, DetectionSettings]] = None) -> Pipeline:
        """A pipeline continuing from stored :meth:`changed_parts` (every key's latest value). ValueError
        when the header is missing or not of a version this code reads. A run or cluster part that cannot
        be read is left out -- that run is quarantined (counted, listed) and its part deleted by the next
        :meth:`changed_parts` -- and everything else restored."""
        if "header" not in parts:
            raise ValueError("no pipeline snapshot header among the parts")
        header = _parse_part(parts["header"], "header")
        if header.get("format") != SNAPSHOT_FORMAT or header.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"pipeline snapshot parts of version {header.get('version')!r} are not "
                             f"supported (this code reads version {SNAPSHOT_VERSION})")
        pipeline = cls(settings, project_settings)
        runs: List[Tuple[int, RunState]] = []
        clusters: List[Tuple[int, ClusterState]] = []
        sizes: List[Tuple[RunState, int]] = []  # the runs' sizes as stored: the state-bytes quota's measure
        for name, blob in parts.items():
            try:
                if name.startswith("run/"):
                    doc = _parse_part(blob, name)
                    runs.append((int(doc["seq"]), RunState.from_json(doc["run"])))
                    sizes.append((runs[-1][1], len(blob)))
                elif name.startswith("cluster/"):
                    doc = _parse_part(blob, name)
                    clusters.append((int(doc["seq"]), ClusterState.from_json(doc["cluster"])))
            except Exception as exc:  # whatever one part holds (OverflowError: 1e400; IndexError: a short
                pipeline._unreadable_part(name, exc)  # list) leaves that part out, never the partition
        for seq, run in sorted(runs, key=lambda item: item[0]):
            pipeline._runs[run.key] = run
            pipeline._run_seq[run.key] = seq
        for seq, cluster in sorted(clusters, key=lambda item: item[0]):
            key = cluster_key(cluster.record.project, cluster.record.fingerprint)
            pipeline._clusters[key] = cluster
            pipeline._cluster_seq[key] = seq
        pipeline._next_seq = int(header.get("next_seq", 0))
        pipeline._evicted = EvictedRuns((str(k), int(t)) for k, t in header.get("evicted", []))
        pipeline._index = ProjectIndex.of_state(pipeline._runs, pipeline._clusters)
        for run, nbytes in sizes:
            pipeline._index.size_run(run.project, run.key, nbytes)
        unreadable = list(pipeline._unreadable_parts)
        pipeline.counters.update({k: int(v) for k, v in header.get("counters", {}).items() if k in COUNTERS})
        pipeline.counters["runs_quarantined"] += sum(1 for n in unreadable if n.startswith("run/"))
        pipeline.parts_saved()
        pipeline._unreadable_parts = unreadable
        return pipeline

    def _unreadable_part(self, name: str, exc: BaseException) -> None:
        """A stored part ``restore_parts`` could not read: listed as quarantined, deleted at the next
        checkpoint."""
        self._unreadable_parts.append(name)
        project, _sep, run_id = name.split("/", 1)[1].partition("%00")
        if len(self.quarantined) < QUARANTINE_LIST_MAX:
            self.quarantined.append(Quarantined(project, run_id, f"stored part {name!r} cannot be read: "
                                                                 f"{_error_text(exc)}"))

    @classmethod
    def restore(cls, data: bytes, settings: Optional[DetectionSettings] = None,
                project_settings: Optional[Mapping[str, DetectionSettings]] = None) -> Pipeline:
        """A pipeline continuing from ``data`` (from :meth:`snapshot`) under ``settings``.
        ValueError when ``data`` is not a snapshot of a version this code reads."""
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a pipeline snapshot: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != SNAPSHOT_FORMAT:
            raise ValueError("not a pipeline snapshot (format field missing or wrong)")
        if doc.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"pipeline snapshot version {doc.get('version')!r} is not supported "
                             f"(this code reads version {SNAPSHOT_VERSION})")
        pipeline = cls(settings, project_settings)
        lost = 0
        for item in doc.get("runs", []):
            try:
                run = RunState.from_json(item)
            except Exception as exc:
                lost += 1  # that run alone is left out: quarantined
                who = item if isinstance(item, dict) else {}
                pipeline.quarantined.append(Quarantined(
                    str(who.get("project", "")), str(who.get("run_id", "")),
                    f"its snapshot cannot be read: {_error_text(exc)}"))
                continue
            pipeline._runs[run.key] = run
        for item in doc.get("clusters", []):
            try:
                cluster = ClusterState.from_json(item)
            except Exception:
                continue  # a cluster's record stays in the stores; a later occurrence starts it again
            pipeline._clusters[cluster_key(cluster.record.project, cluster.record.fingerprint)] = \
                cluster
        pipeline._evicted = EvictedRuns((str(k), int(t)) for k, t in doc.get("evicted", []))
        pipeline.counters.update({k: int(v) for k, v in doc.get("counters", {}).items() if k in COUNTERS})
        pipeline.counters["runs_quarantined"] += lost
        pipeline._index = ProjectIndex.of_state(pipeline._runs, pipeline._clusters)
        pipeline._unsaved_runs = dict.fromkeys(pipeline._runs)  # no parts stored yet: all of it changed
        pipeline._unsaved_clusters = dict.fromkeys(pipeline._clusters)
        return pipeline


_EMPTY_RANKS = b',"ranks":[]'
_NO_STATE: Final[Dict[str, Any]] = {}  # (read only)


def _judged(detectors: Dict[str, Any]) -> Any:
    """``detectors.get(straggler.RUN_KEY, {}).get("judged")``: the run-wide straggler part's last judged
    step (compiled: a dict read when the part is a dict, as this code writes it)."""
    part = detectors.get(straggler.RUN_KEY, _NO_STATE)
    if isinstance(part, dict):
        run_part: Dict[str, Any] = part
        return run_part.get("judged")
    return part.get("judged")  # (a foreign part's: read, or raise, as before)
_NO_RANKS: Final[Set[int]] = set()  # (read only: a run with no rank touched yet)


def _part(prefix: str, key: str) -> str:
    """The part name of a run or cluster key (NUL-separated) -- printable: ``%`` and NUL escaped."""
    return prefix + key.replace("%", "%25").replace("\x00", "%00")


def _json_bytes(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("ascii")


def _parse_part(blob: bytes, name: str) -> Dict[str, Any]:
    try:
        doc = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"pipeline snapshot part {name!r} unreadable: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"pipeline snapshot part {name!r} is not an object")
    return doc


def _info(ev: ReadEnvelope, step: int) -> EventInfo:
    return EventInfo(ev.raw, ev.body, step, ev.time_ns, ev.event_id)


def _step_of(ev: ReadEnvelope, rank: RankState) -> int:
    """The step an error event belongs to: its own, else (-1: a log line or a traceback read from a log
    by the agent or ``trainguard replay``, which do not know it) the last step the rank reported."""
    return ev.step if ev.step >= 0 else rank.max_step


def run_status(run: RunState) -> str:
    """failed > finished > lost > stalled > running (see the module docstring)."""
    if run.failed():
        return RUN_FAILED
    if run.ended():
        return RUN_FINISHED
    if run.lost:
        return RUN_LOST
    if run.open_incident(progress.STALL_PREFIX) is not None:
        return RUN_STALLED
    return RUN_RUNNING


def run_record(run: RunState) -> RunRecord:
    """The RunRecord of ``run`` as the state says now."""
    open_states = incident_mod.open_incidents(run)
    worst = incident_mod.worst_severity(open_states)
    health = "critical" if worst in ("error", "critical") else "warning" if worst == "warning" else "healthy"
    ranks = sorted(run.ranks)
    hosts = [h for h in dict.fromkeys(run.ranks[r].host for r in ranks) if h]  # first seen first
    return RunRecord(
        project=run.project, run_id=run.run_id, run_name=run.run_name, trace_id=run.trace_id,
        status=run_status(run), health=health, started_ns=run.started_ns or run.first_ns,
        last_event_ns=run.last_event_ns,
        last_progress_ns=max((s.progress_ns for s in run.ranks.values()), default=0),
        last_step=run.last_step(), world_size=run.world_size, ranks=ranks, hosts=hosts, tags=dict(run.tags),
        exit_codes={str(r): run.ranks[r].exit_code for r in ranks if run.ranks[r].exited},
        open_incidents=len(open_states), step_time_s=round(run.step_time(), 9))
