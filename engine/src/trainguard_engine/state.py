"""The pipeline's explicit state: per run, per rank, per incident and per cluster, with a JSON codec.

Everything the pipeline knows lives in these objects, so a snapshot (:mod:`json` of ``to_json()``) and a
restore (``from_json``) give a pipeline that continues exactly as the original would have. Every
collection is bounded by a :class:`~trainguard_engine.catalogue.DetectionSettings` field (the bound is named
where the collection is declared). The elementary updates (a step observed, a metric point, a heartbeat)
are methods here; deciding what they mean is the detectors' job. Pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Final, List, Optional, Sequence, Tuple

from trainguard.core.events import from_wire_float, wire_float

from .catalogue import DetectionSettings
from .records import INCIDENT_RESOLVED, Cluster, Incident

STEP_TIME_EWMA_ALPHA = 0.1
"""Weight of a new observation in the per-rank step-time average (the SDK uses the same)."""
_KEEP_ONE = (True,)
"""``keep`` of a one-point :meth:`RankState.observe_points` call."""

RETIRED_KEYS: Dict[Tuple[str, str], Tuple[str, ...]] = {("lg", "loss"): ("stuck",)}
"""(detector state key, part) -> keys of that part of a rank's detector state that snapshots of earlier
code carry but this code derives and never reads: a restore drops them, so the restored pipeline's later
snapshots are those of a pipeline that ran this code from the start. ``lg.loss.stuck``: the loss curve's
memo of why nothing moves the weights, rewritten on every loss value until stop 40 (now in
:attr:`RankState.derived`, outside the snapshot)."""

# A history point: (value, event time in ns; 0 when it came from an alert's context and has no time).
HistoryPoint = Tuple[float, int]


RANK_KINDS: Final[Dict[str, str]] = {
    "rank": "int", "host": "str", "pid": "int", "first_ns": "int", "last_ns": "int", "started_ns": "int",
    "max_step": "int", "progress_ns": "int", "step_time_s": "float", "sdk_step_time_s": "float",
    "last_hb_ns": "int", "exited": "bool", "exit_code": "int", "exit_signal": "int", "exit_reason": "str",
    "exit_ns": "int", "exc_key": "str", "hb_interval_s": "float", "lost_ns": "int"}
"""What :meth:`RankState.from_json` accepts in each scalar field (see :func:`check_kinds`)."""

RUN_KINDS: Final[Dict[str, str]] = {
    "project": "str", "run_id": "str", "run_name": "str", "trace_id": "str", "world_size": "int",
    "tags": "dict", "started_ns": "int", "first_ns": "int", "last_event_ns": "int", "lost": "bool",
    "lost_since_ns": "int", "episodes": "dict", "emitted": "str", "touched": "int"}
"""What :meth:`RunState.from_json` accepts in each scalar field (see :func:`check_kinds`)."""


def check_kinds(owner: str, plain: Dict[str, Any], kinds: Dict[str, str]) -> None:
    """TypeError when a restored ``owner``'s field does not hold what this code writes there: "int" an int
    (not a bool), "float" a finite float (or an int), "str" a str, "bool" a bool, "dict" a dict. A part
    from a foreign or corrupt writer is refused at restore -- its run quarantined, the rest restored --
    instead of failing later outside the run: a store's upsert retried forever (``"x"`` or 1e400 as a
    time), the header's JSON (an infinite eviction time). Names not in ``kinds`` are left to the
    constructor (which refuses unknown ones). Ints are not bounded: the pipeline keeps any int an event
    gave it (the gateway bounds what it lets through)."""
    for name, value in plain.items():
        kind = kinds.get(name)
        if kind is None:
            continue
        if kind == "int":
            ok = type(value) is int
        elif kind == "float":
            ok = (type(value) is float and math.isfinite(value)) or type(value) is int
        elif kind == "str":
            ok = type(value) is str
        elif kind == "bool":
            ok = type(value) is bool
        else:
            ok = type(value) is dict
        if not ok:
            shown = "a non-finite float" if type(value) is float else f"a {type(value).__name__}"
            raise TypeError(f"{owner}.{name} holds {shown}, where this code writes {kind}")


def bounded_put(mapping: Dict[Any, Any], key: Any, value: Any, most: int) -> None:
    """Insert ``key`` (as the most recent entry) into an insertion-ordered dict of at most ``most``
    entries, dropping the oldest."""
    mapping.pop(key, None)
    mapping[key] = value
    while len(mapping) > most:
        del mapping[next(iter(mapping))]


def bounded_append(items: List[Any], item: Any, most: int) -> None:
    """Append, keeping at most ``most`` items: beyond it the item in the middle goes, so the beginning
    (how it started) and the most recent entries (how it goes) both survive."""
    items.append(item)
    while len(items) > most:
        del items[most // 2]


class Shiftable:
    """What a detector keeps beside a :class:`SeriesTail` (``windows``) and can carry over a trim."""

    def shifted(self, drop: int) -> bool:
        """Move every point index kept by ``-drop`` (the tail lost its first ``drop`` points, the others
        unchanged and in the same order); False when what is kept needs a dropped point (then it is
        dropped with the old tail)."""
        return False


class SeriesTail:
    """A history series as ``(step, value, time_ns)`` triples in arrival order, kept beside its dict so the
    detectors' "last N points" reads (:func:`~trainguard_engine.detectors.numeric.recent`) are a slice, not
    a rebuild: derived, never serialized. Valid while ``data`` is the series' dict and their lengths agree
    (:meth:`RankState.observe_point` appends to it, and drops it when a point replaces one or a trim
    replaces the dict). ``bad_end``: index + 1 of the last non-finite point; ``descent``: index of the
    last point whose step was not above its predecessor's (0: none) -- a window starting at or after
    both is finite and in step order. ``windows``: what a detector derives from the last points and
    updates as points arrive (e.g. the loss curve's sorted windows, keyed by the detector), dropped with
    the tail."""

    def __init__(self, data: Dict[int, HistoryPoint], build: bool = True) -> None:
        self.data = data
        self.points: List[Tuple[int, float, int]] = []
        self.bad_end = 0
        self.descent = 0
        self.windows: Dict[Any, Any] = {}
        if build:
            for s, (v, t) in data.items():
                self.append(s, v, t)

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        """Copied and pickled as its fields (copy, deepcopy, pickle): a compiled class cannot be made without
        ``data`` the way ``copyreg`` makes an object, so both builds rebuild it from them (:func:`_tail`)."""
        return _tail, (self.data, self.points, self.bad_end, self.descent, self.windows)

    def trimmed(self, data: Dict[int, HistoryPoint], drop: int) -> SeriesTail:
        """The tail of ``data``, this series trimmed of its ``drop`` lowest steps -- for a tail whose steps
        only rose (``descent`` 0: its points are the series by step), a slice instead of a rebuild. What a
        detector keeps in ``windows`` by point index goes with it when it can move its indices back by
        ``drop`` (a ``shifted(drop)`` method that answers True: :meth:`Shiftable.shifted`); the rest is
        dropped, as with a new tail."""
        out = SeriesTail(data, False)
        out.points = self.points[drop:]
        out.bad_end = max(0, self.bad_end - drop)
        out.descent = 0
        out.windows = {}
        for key, kept in self.windows.items():
            if isinstance(kept, Shiftable) and kept.shifted(drop):
                out.windows[key] = kept
        return out

    def append(self, step: int, value: float, time_ns: int) -> None:
        points = self.points
        if points and step <= points[-1][0]:
            self.descent = len(points)
        points.append((step, value, time_ns))
        if value - value != 0.0:  # NaN or +-Inf
            self.bad_end = len(points)


def _tail(data: Dict[int, HistoryPoint], points: List[Tuple[int, float, int]], bad_end: int, descent: int,
          windows: Dict[Any, Any]) -> SeriesTail:
    """A :class:`SeriesTail` from its fields, as :meth:`SeriesTail.__reduce__` hands them."""
    out = SeriesTail(data, False)
    out.points, out.bad_end, out.descent, out.windows = points, bad_end, descent, windows
    return out


@dataclass
class RankState:
    """One process of a run."""

    rank: int
    host: str = ""
    pid: int = 0
    first_ns: int = 0
    last_ns: int = 0
    started_ns: int = 0          # time of its START event, 0 if none seen
    max_step: int = -1           # highest step seen in metrics and heartbeats
    progress_ns: int = 0         # when the step last advanced (event time, or the SDK's own record)
    step_time_s: float = 0.0     # EWMA of seconds per step, from step advances seen here
    sdk_step_time_s: float = 0.0  # the SDK's own EWMA (heartbeats), preferred when known
    last_hb_ns: int = 0
    exited: bool = False
    exit_code: int = 0
    exit_signal: int = 0
    exit_reason: str = ""
    exit_ns: int = 0
    exc_key: str = ""            # incident slot of its last uncaught exception ("" if none)
    hb_interval_s: float = 0.0   # average spacing of its heartbeats (0: fewer than two seen)
    lost_ns: int = 0             # when correlation declared it lost (silent while its peers failed)
    # name -> {step: (value, time_ns)}; at most history_max_series names x 2 history_len steps
    history: Dict[str, Dict[int, HistoryPoint]] = field(default_factory=dict)
    history_floor: Dict[str, int] = field(default_factory=dict)  # name -> lowest step still accepted
    # name -> (step, time_ns) of its first non-finite value (history names only)
    first_nonfinite: Dict[str, Tuple[int, int]] = field(default_factory=dict)
    # detector family -> its streaming state for this rank: small, JSON-able (finite floats only), bounded
    # by the family's own settings (see trainguard_engine.detectors.numeric.rank_state)
    detectors: Dict[str, Any] = field(default_factory=dict)
    # name -> its SeriesTail, for the series the detectors read the last points of (derived: not serialized)
    tails: Dict[str, SeriesTail] = field(default_factory=dict, compare=False, repr=False)
    # what a detector derives per rank and keeps between its calls, keyed by the detector (e.g. the loss
    # curve's memo of why nothing moves the weights): derived, never serialized, per rank -- never module
    # state, which every pipeline of the process (threads) would share
    derived: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # --- elementary updates -----------------------------------------------------------------
    def touch(self, time_ns: int, host: str, pid: int) -> None:
        """An event of this rank was observed at ``time_ns`` (Pipeline._fold inlines it: change both)."""
        if host:
            self.host = host
        if pid:
            self.pid = pid
        if self.first_ns == 0 or 0 < time_ns < self.first_ns:
            self.first_ns = time_ns
        self.last_ns = max(self.last_ns, time_ns)

    def observe_step(self, step: int, time_ns: int) -> bool:
        """A metric at ``step`` was logged at ``time_ns``; True when the step advanced (progress)."""
        if step <= self.max_step:
            return False
        if self.max_step >= 0 and self.progress_ns > 0 and time_ns > self.progress_ns:
            per_step = (time_ns - self.progress_ns) / 1e9 / (step - self.max_step)
            self.step_time_s = per_step if self.step_time_s == 0.0 else (
                (1 - STEP_TIME_EWMA_ALPHA) * self.step_time_s + STEP_TIME_EWMA_ALPHA * per_step)
        self.max_step = step
        self.progress_ns = max(self.progress_ns, time_ns)
        return True

    def observe_heartbeat(self, last_step: int, last_step_time_ns: int, step_time_ewma_s: float,
                          time_ns: int) -> None:
        """A heartbeat: the SDK's last step, when it last progressed and its step-time average."""
        if last_step > self.max_step:
            self.max_step = last_step
            self.progress_ns = max(self.progress_ns, last_step_time_ns or time_ns)
        if last_step_time_ns > self.progress_ns:
            self.progress_ns = last_step_time_ns  # optimizer steps count even when the label is unchanged
        if step_time_ewma_s > 0 and math.isfinite(step_time_ewma_s):
            self.sdk_step_time_s = step_time_ewma_s
        if 0 < self.last_hb_ns < time_ns:
            gap = (time_ns - self.last_hb_ns) / 1e9
            self.hb_interval_s = gap if self.hb_interval_s == 0.0 else 0.7 * self.hb_interval_s + 0.3 * gap
        self.last_hb_ns = max(self.last_hb_ns, time_ns)

    def observe_point(self, name: str, step: int, value: float, time_ns: int,
                      settings: DetectionSettings, context: bool = False) -> None:
        """Keep a metric value in the history (if ``name`` has one). ``context`` points (an alert's
        recent values) only fill steps the history does not have yet. A series keeps at least its last
        ``history_len`` steps: it is trimmed back to that many when it reaches twice as many, and steps
        below what a trim kept are ignored from then on (so a replay cannot bring them back)."""
        if context:
            series = self.history.get(name)
            if series is not None and step in series:
                return
            time_ns = 0  # a context point has no event time
        self.observe_points(((name, step, value),), _KEEP_ONE, time_ns, settings)

    def observe_points(self, points: Sequence[Tuple[str, Any, Any]], keep: Sequence[bool], time_ns: int,
                       settings: DetectionSettings) -> None:
        """:meth:`observe_point` of each of ``points`` (one envelope's, in order) whose ``keep`` is true, at
        ``time_ns``, in one call an envelope (the pipeline keeps every metric point a history is kept for;
        the settings read once, the dicts held in locals): the one implementation of keeping a point.

        Each point's step and value objects are stored as they came (compiled: ``at`` boxed once, no float
        or int made per point; the value unboxed only for the finiteness test)."""
        history, floors, tails = self.history, self.history_floor, self.tails
        max_series, history_len = settings.history_max_series, settings.history_len
        limit = 2 * history_len
        at: Any = time_ns
        keeps = keep if isinstance(keep, tuple) else tuple(keep)  # (a route's: a tuple, read by index)
        n = len(keeps)
        i = -1
        for point in points:
            i += 1
            if i >= n:  # (as zip(points, keep): the shorter ends it)
                break
            if not keeps[i]:
                continue
            name, step, value = point
            series = history.get(name)
            if series is None:
                if len(history) >= max_series:
                    continue
                series = history[name] = {}
            if floors:
                floor: Any = floors.get(name)  # (an object: compared with the point's step, not boxed again)
                if floor is not None and step < floor:
                    continue
            if step in series:  # a point replaced: the tail no longer matches the series
                series[step] = (value, at)
                if name in tails:
                    del tails[name]
            else:
                series[step] = (value, at)
                tail = tails.get(name)
                if tail is not None:
                    tail_points: List[Any] = tail.points
                    if tail_points and step <= tail_points[-1][0]:
                        tail.descent = len(tail_points)
                    tail_points.append((step, value, at))
                    number: float = value
                    if number - number != 0.0:  # NaN or +-Inf
                        tail.bad_end = len(tail_points)
            if len(series) > limit:
                kept: Dict[Any, Any] = series  # (objects: its steps and points kept as they are, not rebuilt)
                kept_steps: List[Any] = sorted(kept)[-history_len:]
                floors[name] = kept_steps[0]
                trimmed = history[name] = {s: kept[s] for s in kept_steps}
                tail = tails.pop(name, None)
                if tail is not None and tail.descent == 0 and tail.data is series and \
                        len(tail.points) == len(series):
                    tails[name] = tail.trimmed(trimmed, len(series) - len(trimmed))
            number = value
            if number - number != 0.0:  # NaN or +-Inf
                first = self.first_nonfinite.get(name)
                if first is None or step < first[0]:
                    self.first_nonfinite[name] = (step, time_ns)

    def step_time(self) -> float:
        """Seconds per step: the SDK's measurement when it sent one, else what the steps' pace shows."""
        return self.sdk_step_time_s if self.sdk_step_time_s > 0 else self.step_time_s

    def series(self, name: str, lo: int, hi: int) -> List[Tuple[int, float, int]]:
        """``(step, value, time_ns)`` of ``name`` for lo <= step <= hi, by step."""
        data = self.history.get(name, {})
        return [(s, v, t) for s, (v, t) in sorted(data.items()) if lo <= s <= hi]

    # --- codec ----------------------------------------------------------------------------------
    def to_json(self) -> Dict[str, Any]:
        return {
            "rank": self.rank, "host": self.host, "pid": self.pid, "first_ns": self.first_ns,
            "last_ns": self.last_ns, "started_ns": self.started_ns, "max_step": self.max_step,
            "progress_ns": self.progress_ns, "step_time_s": self.step_time_s,
            "sdk_step_time_s": self.sdk_step_time_s, "last_hb_ns": self.last_hb_ns,
            "exited": self.exited, "exit_code": self.exit_code, "exit_signal": self.exit_signal,
            "exit_reason": self.exit_reason, "exit_ns": self.exit_ns, "exc_key": self.exc_key,
            "hb_interval_s": self.hb_interval_s, "lost_ns": self.lost_ns,
            # each series in its dict's (arrival) order, not by step: recent() reads the last points
            # received, a late point among them, and a restore must read the same (a snapshot of before
            # stop 40 was written by step: it is read in that order, as it was then)
            "history": {name: [[s, wire_float(v), t] for s, (v, t) in series.items()]
                        for name, series in self.history.items()},
            "history_floor": self.history_floor,
            "first_nonfinite": {name: list(v) for name, v in self.first_nonfinite.items()},
            "detectors": self.detectors,
        }

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> RankState:
        plain = {k: v for k, v in data.items()
                 if k not in ("history", "history_floor", "first_nonfinite", "detectors")}
        check_kinds("rank", plain, RANK_KINDS)
        state = cls(**plain)
        state.detectors = dict(data.get("detectors", {}))
        for (family, part), keys in RETIRED_KEYS.items():
            kept = state.detectors.get(family)
            if not isinstance(kept, dict):
                continue
            inner = kept.get(part)
            if isinstance(inner, dict) and not inner.keys().isdisjoint(keys):
                state.detectors[family] = {**kept, part: {k: v for k, v in inner.items() if k not in keys}}
        state.history_floor = {name: int(v) for name, v in data.get("history_floor", {}).items()}
        state.history = {name: {int(s): (from_wire_float(v), int(t)) for s, v, t in points}
                         for name, points in data.get("history", {}).items()}
        state.first_nonfinite = {name: (int(v[0]), int(v[1]))
                                 for name, v in data.get("first_nonfinite", {}).items()}
        return state


@dataclass
class IncidentState:
    """One incident of a run and what the pipeline needs to keep folding signals into it."""

    key: str                     # slot within the run: "exc:<fingerprint>", "numeric", "stall:1", ...
    record: Incident
    rank_first: Dict[int, Tuple[int, int]] = field(default_factory=dict)  # rank -> (time_ns, step)
    values: Dict[str, Any] = field(default_factory=dict)  # title placeholders
    extra: Dict[str, Any] = field(default_factory=dict)   # detector-specific, JSON-able
    emitted: str = ""            # digest of the record last emitted
    dirty: bool = False          # changed since the last output (never serialized: always False then)
    # its run's incident-change counter (RunState.changes, the same list once the incident is in a run:
    # incidents.apply's _open, RunState.from_json): derived, never serialized
    changes: List[int] = field(default_factory=lambda: [0], compare=False, repr=False)

    @property
    def is_open(self) -> bool:
        return self.record.status != INCIDENT_RESOLVED

    def changed(self) -> None:
        """Count a change of what the incident says about its members -- its status, kind or ranks
        (:attr:`RunState.changes`)."""
        self.changes[0] += 1

    def to_json(self) -> Dict[str, Any]:
        return {"key": self.key, "record": self.record.to_dict(),
                "rank_first": [[r, t, s] for r, (t, s) in self.rank_first.items()],
                "values": self.values, "extra": self.extra, "emitted": self.emitted}

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> IncidentState:
        return cls(key=data["key"], record=Incident.from_dict(data["record"]),
                   rank_first={int(r): (int(t), int(s)) for r, t, s in data.get("rank_first", [])},
                   values=dict(data.get("values", {})), extra=dict(data.get("extra", {})),
                   emitted=data.get("emitted", ""))


@dataclass
class ClusterState:
    """One stack-fingerprint cluster of a project."""

    record: Cluster
    sample_key: Tuple[int, str] = (0, "")   # (time_ns, event_id) of the sample: the earliest exception
    emitted: str = ""
    touched: int = 0             # the pipeline's arrival count at its last exception (quota eviction order)
    dirty: bool = False

    def to_json(self) -> Dict[str, Any]:
        return {"record": self.record.to_dict(), "sample_key": list(self.sample_key),
                "emitted": self.emitted, "touched": self.touched}

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> ClusterState:
        key = data.get("sample_key", [0, ""])
        return cls(record=Cluster.from_dict(data["record"]), sample_key=(int(key[0]), str(key[1])),
                   emitted=data.get("emitted", ""), touched=int(data.get("touched", 0)))


@dataclass
class RunState:
    """Everything known about one run (all of its ranks)."""

    project: str
    run_id: str
    run_name: str = ""
    trace_id: str = ""
    world_size: int = 1
    tags: Dict[str, str] = field(default_factory=dict)
    started_ns: int = 0          # earliest START event, 0 if none seen
    first_ns: int = 0
    last_event_ns: int = 0
    ranks: Dict[int, RankState] = field(default_factory=dict)      # at most max_ranks_per_run
    incidents: Dict[str, IncidentState] = field(default_factory=dict)  # at most max_incidents_per_run
    seen: Dict[str, None] = field(default_factory=dict)  # notable event ids, at most dedupe_ids_per_run
    lost: bool = False
    lost_since_ns: int = 0       # last_event_ns when it was declared lost
    episodes: Dict[str, int] = field(default_factory=dict)  # "stall"/"lost" -> episodes opened so far
    emitted: str = ""
    touched: int = 0             # the pipeline's arrival count at its last event (quota eviction order)
    dirty: bool = False
    changes: List[int] = field(default_factory=lambda: [0], compare=False, repr=False)
    """How many times an incident of the run opened or changed its status, kind or ranks (one counter, in a
    list each of its :class:`IncidentState` shares: :func:`~trainguard_engine.incidents.apply` and
    :func:`~trainguard_engine.incidents.resolve` count, correlation too when it moves ranks into a cause).
    While it and the number of incidents stay the same, whatever is read from the incidents' status, kind
    and ranks stays the same (the loss curve's gates, :func:`~.detectors.loss._gates`). Derived, never
    serialized (a restored run starts at 0 with new ranks, whose memos start empty)."""

    @property
    def key(self) -> str:
        return run_key(self.project, self.run_id)

    def first_rank(self) -> RankState:
        """``ranks[next(iter(ranks))]``, the first rank seen (StopIteration when there is none), read by a
        loop (compiled: no builtin called)."""
        for rank in self.ranks.values():
            return rank
        raise StopIteration

    def rank_state(self, rank: int, settings: DetectionSettings) -> Optional[RankState]:
        """The state of ``rank``, created on first sight; None beyond max_ranks_per_run."""
        state = self.ranks.get(rank)
        if state is None:
            if len(self.ranks) >= settings.max_ranks_per_run:
                return None
            state = self.ranks[rank] = RankState(rank)
        return state

    def remember(self, event_id: str, settings: DetectionSettings) -> bool:
        """Record a notable event id; False when it was seen already (a replayed duplicate)."""
        if event_id in self.seen:
            return False
        bounded_put(self.seen, event_id, None, settings.dedupe_ids_per_run)
        return True

    def ended(self) -> bool:
        """Every rank exited (or was declared lost), and at least world_size ranks were seen."""
        return bool(self.ranks) and len(self.ranks) >= self.world_size and \
            all(r.exited or r.lost_ns for r in self.ranks.values())

    def failed(self) -> bool:
        """A rank exited non-zero or by a signal, or was declared lost (killed without a word)."""
        return any((r.exited and (r.exit_code != 0 or r.exit_signal != 0)) or r.lost_ns
                   for r in self.ranks.values())

    def step_time(self) -> float:
        """The run's seconds per step: its slowest rank's (ranks of one job wait for each other)."""
        return max((r.step_time() for r in self.ranks.values()), default=0.0)

    def last_step(self) -> int:
        return max((r.max_step for r in self.ranks.values()), default=-1)

    def open_incident(self, prefix: str) -> Optional[IncidentState]:
        """The open incident whose key starts with ``prefix`` (e.g. ``"stall:"``), if any."""
        for st in self.incidents.values():
            if st.key.startswith(prefix) and st.is_open:
                return st
        return None

    def next_episode(self, name: str) -> int:
        self.episodes[name] = self.episodes.get(name, 0) + 1
        return self.episodes[name]

    def to_json(self, with_ranks: bool = True) -> Dict[str, Any]:
        """The run as JSON-able data; ``with_ranks=False``: its ``ranks`` an empty list (in the same place:
        the pipeline joins each rank's own encoding in there, byte for byte the whole encoding)."""
        return {
            "project": self.project, "run_id": self.run_id, "run_name": self.run_name,
            "trace_id": self.trace_id, "world_size": self.world_size, "tags": self.tags,
            "started_ns": self.started_ns, "first_ns": self.first_ns, "last_event_ns": self.last_event_ns,
            "ranks": [r.to_json() for r in self.ranks.values()] if with_ranks else [],
            "incidents": [i.to_json() for i in self.incidents.values()],
            "seen": list(self.seen), "lost": self.lost, "lost_since_ns": self.lost_since_ns,
            "episodes": self.episodes, "emitted": self.emitted, "touched": self.touched,
        }

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> RunState:
        plain = {k: v for k, v in data.items() if k not in ("ranks", "incidents", "seen")}
        check_kinds("run", plain, RUN_KINDS)
        state = cls(**plain)
        state.ranks = {r["rank"]: RankState.from_json(r) for r in data.get("ranks", [])}
        state.incidents = {i["key"]: IncidentState.from_json(i) for i in data.get("incidents", [])}
        for st in state.incidents.values():
            st.changes = state.changes
        state.seen = dict.fromkeys(data.get("seen", []))
        return state


def run_key(project: str, run_id: str) -> str:
    """The state key of a run (project and run id cannot contain NUL on the wire)."""
    return f"{project}\x00{run_id}"


def cluster_key(project: str, fingerprint: str) -> str:
    return f"{project}\x00{fingerprint}"
