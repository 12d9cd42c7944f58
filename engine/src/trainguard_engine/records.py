"""What the pipeline decides, as plain records: runs, incidents (with evidence and a timeline) and
stack-fingerprint clusters. Pure data with ``to_dict``/``from_dict`` so every runtime (embedded, Flink) and
every store (SQLite, Elasticsearch, ClickHouse) moves the same shapes.

Records are *upserts*: the pipeline always emits the whole current record, so applying an output twice
(at-least-once processing after a crash) leaves the stores in the same state.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple, Type, TypeVar

T = TypeVar("T")

# Run statuses, from the backend's point of view.
RUN_RUNNING = "running"
RUN_FINISHED = "finished"      # every rank that reported an exit exited 0
RUN_FAILED = "failed"          # a rank exited non-zero or crashed
RUN_STALLED = "stalled"        # alive (heartbeats) but no progress
RUN_LOST = "lost"              # silent: no event for far longer than its heartbeat interval

INCIDENT_OPEN = "open"          # just detected
INCIDENT_ONGOING = "ongoing"    # detected, and new evidence keeps arriving
INCIDENT_RESOLVED = "resolved"  # the condition cleared (progress resumed) or a person resolved it

SEVERITY_ORDER = {"info": 0, "warning": 1, "error": 2, "critical": 3}


MAX_DEPTH = 200
"""How deep the JSON-shaped values records hold may nest (lists, tuples, dicts in one another) for
:func:`_plain` and :func:`finite_copy`: deeper is malformed (ValueError, the same in both builds -- pure
Python would hit the recursion limit near 1,000 levels, compiled code the C stack much later). What the
gateway lets through nests at most 100 levels (protobuf's limit), an envelope's own fields a few."""


def too_deep() -> ValueError:
    """The error of a value nested past :data:`MAX_DEPTH`."""
    return ValueError(f"a value nested more than {MAX_DEPTH} levels deep")


def _plain(value: Any, depth: int = 0) -> Any:
    """A copy of ``value`` with every list, tuple and dict copied (what ``dataclasses.asdict`` does to a
    field's value, for the JSON-shaped values records hold; leaves are immutable scalars), ~10x faster.
    Raises ValueError past :data:`MAX_DEPTH`."""
    kind = type(value)
    if kind is dict or kind is list or kind is tuple:
        if depth >= MAX_DEPTH:
            raise too_deep()
        if kind is dict:
            return {k: _plain(v, depth + 1) for k, v in value.items()}
        if kind is list:
            return [_plain(v, depth + 1) for v in value]
        return tuple(_plain(v, depth + 1) for v in value)
    if kind in (str, int, float, bool) or value is None:
        return value
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return asdict(value) if hasattr(value, "__dataclass_fields__") else copy.deepcopy(value)


_FIELD_NAMES: Dict[type, Tuple[str, ...]] = {}


def _fields_dict(obj: Any) -> Dict[str, Any]:
    """``asdict(obj)`` for a record (its fields in declaration order, read once per class)."""
    names = _FIELD_NAMES.get(type(obj))
    if names is None:
        names = _FIELD_NAMES[type(obj)] = tuple(f.name for f in fields(obj))
    return {name: _plain(getattr(obj, name)) for name in names}


def _from_dict(cls: Type[T], data: Dict[str, Any]) -> T:
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class Evidence:
    """Why the rule fired: the rule, its threshold, the value seen and the window of values around it."""

    rule: str                   # "loss.non_finite", "exit.code", "progress.stalled", ...
    description: str
    step: int = -1
    time_ns: int = 0
    rank: int = -1
    metric: str = ""
    threshold: Optional[float] = None
    value: Optional[Any] = None  # a float, "NaN"/"Infinity", an exit code, ...
    window: List[Dict[str, Any]] = field(default_factory=list)  # [{"step", "value"}] in the JSON mapping
    event_id: str = ""

    def to_dict(self) -> Dict[str, Any]:
        return _fields_dict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> Evidence:
        return _from_dict(cls, data)


@dataclass
class TimelineEntry:
    time_ns: int
    step: int
    rank: int
    what: str                   # "loss became NaN", "rank 3 exited with code 1 (exception)", ...

    def to_dict(self) -> Dict[str, Any]:
        return _fields_dict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> TimelineEntry:
        return _from_dict(cls, data)


@dataclass
class Incident:
    """One thing that went wrong in one run, however many ranks and events reported it."""

    incident_id: str
    project: str
    run_id: str
    category: str               # catalogue category: "loss", "gradient", "memory", "comm", "process", ...
    subtype: str                # "non_finite", "crash", "stalled", "killed", ...
    severity: str               # "info" | "warning" | "error" | "critical"
    status: str = INCIDENT_OPEN
    title: str = ""
    summary: str = ""
    first_step: int = -1
    last_step: int = -1
    first_ns: int = 0
    last_ns: int = 0
    lead_rank: int = -1         # the rank where it started (earliest signal)
    ranks: List[int] = field(default_factory=list)
    hosts: List[str] = field(default_factory=list)
    fingerprint: str = ""
    checks: List[str] = field(default_factory=list)  # what to check first, cheapest first
    evidence: List[Evidence] = field(default_factory=list)
    timeline: List[TimelineEntry] = field(default_factory=list)
    count: int = 1              # signals folded into it
    resolved_ns: int = 0
    # --- diagnosis (seed 000 §3.6), recomputed whenever the incident changes: see diagnosis.py ---
    duration_s: float = 0.0     # last_ns - first_ns
    related: Dict[str, Any] = field(default_factory=dict)   # loss / grad norm / LR / peak memory / ...
    trigger: Dict[str, Any] = field(default_factory=dict)   # LR phase, batch features at first_step
    hypotheses: List[Dict[str, Any]] = field(default_factory=list)  # [{"cause", "confidence", "why"}]
    # --- correlation (correlate.py) ---
    consequences: List[str] = field(default_factory=list)  # what it caused on other ranks, e.g.
    #                                                        "comm/timeout on rank 0"
    explained_by: str = ""      # id of the incident this one is a consequence of (then it is resolved)

    def to_dict(self) -> Dict[str, Any]:
        return _fields_dict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> Incident:
        # converted before the record is built: its fields hold what they say (List[Evidence], ...) from
        # the start -- a compiled engine (engine/native_build.py) checks them as they are set
        data = dict(data)
        if "evidence" in data:
            data["evidence"] = [e if isinstance(e, Evidence) else Evidence.from_dict(e)
                                for e in data["evidence"]]
        if "timeline" in data:
            data["timeline"] = [t if isinstance(t, TimelineEntry) else TimelineEntry.from_dict(t)
                                for t in data["timeline"]]
        return _from_dict(cls, data)


@dataclass
class Cluster:
    """Every exception with one stack fingerprint, across runs, ranks and hosts, in one project."""

    project: str
    fingerprint: str
    fingerprint_version: str
    exc_type: str
    message_template: str
    count: int = 0
    first_ns: int = 0
    last_ns: int = 0
    runs: List[str] = field(default_factory=list)     # capped (MAX_MEMBERS), first seen first
    ranks: List[str] = field(default_factory=list)    # "run_id:rank", capped
    hosts: List[str] = field(default_factory=list)    # capped
    sample_event_id: str = ""
    sample: Dict[str, Any] = field(default_factory=dict)  # type, message, frames, hints, traceback

    def to_dict(self) -> Dict[str, Any]:
        return _fields_dict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> Cluster:
        return _from_dict(cls, data)


@dataclass
class RunRecord:
    """What the backend knows about one run (all of its ranks)."""

    project: str
    run_id: str
    run_name: str = ""
    trace_id: str = ""
    status: str = RUN_RUNNING
    health: str = "healthy"     # "healthy" | "warning" | "critical": worst open incident
    started_ns: int = 0
    last_event_ns: int = 0
    last_progress_ns: int = 0
    last_step: int = -1
    world_size: int = 1
    ranks: List[int] = field(default_factory=list)
    hosts: List[str] = field(default_factory=list)
    tags: Dict[str, str] = field(default_factory=dict)
    exit_codes: Dict[str, int] = field(default_factory=dict)  # rank (as string) -> exit code
    open_incidents: int = 0
    step_time_s: float = 0.0

    def to_dict(self) -> Dict[str, Any]:
        return _fields_dict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> RunRecord:
        return _from_dict(cls, data)


def finite_copy(value: Any, depth: int = 0) -> Any:
    """A copy of a JSON-shaped ``value`` in which every non-finite float is spelled as the proto3 JSON
    mapping spells it (``"NaN"``, ``"Infinity"``, ``"-Infinity"``: what evidence values and the metric API
    use). Records never hold a bare NaN/Inf: the pipeline applies this to a record that would (a value
    computed where no detector sanitised it) and counts it (``counters["nonfinite_encoded"]``). Raises
    ValueError past :data:`MAX_DEPTH`."""
    kind = type(value)
    if kind is float:
        if value - value == 0.0:
            return value
        return "NaN" if value != value else "Infinity" if value > 0 else "-Infinity"
    if kind is dict or kind is list or kind is tuple:
        if depth >= MAX_DEPTH:
            raise too_deep()
        if kind is dict:
            return {k: finite_copy(v, depth + 1) for k, v in value.items()}
        return [finite_copy(v, depth + 1) for v in value]
    return value


def incident_id(project: str, run_id: str, category: str, subtype: str, key: str = "") -> str:
    """Deterministic id: the same incident found twice (replay, two runtimes) gets the same id."""
    digest = hashlib.sha1(f"{project}\x00{run_id}\x00{category}\x00{subtype}\x00{key}".encode()).hexdigest()
    return digest[:24]
