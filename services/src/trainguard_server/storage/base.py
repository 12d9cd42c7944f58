"""Store contracts. Every implementation (memory, SQLite, Elasticsearch, ClickHouse) passes the same
contract suites in tests/services/storage/ (shared helpers: :mod:`.common`). All methods are scoped by
project: no call returns another project's data. Writes are idempotent (event_id; (run, rank, name,
step); record ids), so the processor can re-apply a batch after a crash.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    Dict,
    Generic,
    Iterable,
    Iterator,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
)

from trainguard_engine.records import Cluster, Incident, RunRecord

T = TypeVar("T")


@dataclass
class Page(Generic[T]):
    """One page of results; ``next_cursor`` is opaque and None on the last page."""

    items: List[T]
    next_cursor: Optional[str] = None


@dataclass
class StoredEvent:
    """Raw context kept for search and drill-down: exceptions, logs, lifecycle, alerts."""

    event_id: str
    project: str
    run_id: str
    rank: int
    host: str
    kind: str                  # payload kind: "exception", "log", "lifecycle", "metrics" (alerts), ...
    severity: str
    step: int
    time_ns: int
    text: str                  # what full-text search looks at: type, message, traceback, log line
    payload: Dict[str, Any] = field(default_factory=dict)  # the envelope in the JSON mapping


@dataclass
class SearchHit:
    event: StoredEvent
    snippet: str               # the matching part of ``text`` with the match marked [like this]
    score: float


class MetricPoint(NamedTuple):
    """One metric value of one rank at one step (a tuple: built by the million, ~7x cheaper than a frozen
    dataclass)."""

    project: str
    run_id: str
    rank: int
    name: str
    step: int
    time_ns: int
    value: float               # NaN and +-Inf are legal and stored as such


SeriesColumns = Tuple[List[int], List[int], List[float]]
"""One series' points of a batch as columns ``(steps, times_ns, values)``, in arrival order."""


PointTuple = Tuple[str, int, float]
"""One point of an envelope as the processor reads it: ``(name, step, value)``."""


class MetricColumns:
    """A batch of metric points grouped by series, in columns: ``by_rank[(project, run_id, rank)][name]``
    is that series' :data:`SeriesColumns`. What the processor builds once per round from the decoded
    envelopes and hands to :meth:`MetricStore.put_columns` -- no object per point, one dict lookup per
    envelope and one per point's name. Within a series arrival order is kept, so a later point of a step
    replaces an earlier one exactly as in :meth:`MetricStore.put`."""

    __slots__ = ("by_rank", "count")

    def __init__(self) -> None:
        self.by_rank: Dict[Tuple[str, str, int], Dict[str, SeriesColumns]] = {}
        self.count = 0

    def series_of(self, project: str, run_id: str, rank: int) -> Dict[str, SeriesColumns]:
        """The rank's series by name (made empty on first use)."""
        by_name = self.by_rank.get((project, run_id, rank))
        if by_name is None:
            by_name = self.by_rank[(project, run_id, rank)] = {}
        return by_name

    def add_with(self, add_points: Callable[[Dict[str, SeriesColumns], int, List[PointTuple]], int],
                 project: str, run_id: str, rank: int, time_ns: int,
                 points: List[PointTuple]) -> None:
        """:meth:`add` through ``add_points`` (the processor's native reader's: the same loop in C, which
        returns how many points it added)."""
        self.count += add_points(self.series_of(project, run_id, rank), time_ns, points)

    def add(self, project: str, run_id: str, rank: int, time_ns: int,
            points: Sequence[Tuple[str, int, float]]) -> None:
        """One envelope's points ``(name, step, value)`` (ints and floats as they are: no conversion)."""
        by_name = self.series_of(project, run_id, rank)
        for name, step, value in points:
            cols = by_name.get(name)
            if cols is None:
                cols = by_name[name] = ([], [], [])
            cols[0].append(step)
            cols[1].append(time_ns)
            cols[2].append(value)
        self.count += len(points)

    @classmethod
    def of(cls, points: Iterable[MetricPoint]) -> MetricColumns:
        """``points`` grouped (step and time as int, value as float: as :meth:`MetricStore.put` reads
        them)."""
        out = cls()
        for project, run_id, rank, name, step, time_ns, value in points:
            out.add(project, run_id, int(rank), int(time_ns), ((name, int(step), float(value)),))
        return out

    def points(self) -> Iterator[MetricPoint]:
        """Every point, series by series (arrival order within a series)."""
        for (project, run_id, rank), by_name in self.by_rank.items():
            for name, (steps, times, values) in by_name.items():
                for step, time_ns, value in zip(steps, times, values):
                    yield MetricPoint(project, run_id, rank, name, step, time_ns, value)

    def __len__(self) -> int:
        return self.count


@dataclass
class Bucket:
    """One downsampled bucket: spikes survive because min and max are kept."""

    step_start: int
    step_end: int
    count: int
    min: float
    max: float
    mean: float                # mean of the finite values; NaN if none
    last: float
    nonfinite: int             # NaN/Inf values in the bucket


@dataclass
class MetricSummary:
    name: str
    count: int
    first_step: int
    last_step: int
    min: float
    max: float
    last: float
    nonfinite: int


class EventsRejected(RuntimeError):
    """``EventStore.put`` wrote every event of the batch except ``rejected`` (objects with an HTTP-like
    ``status``; 0 = the store kept failing). :attr:`permanent` when the store refused every one of them for
    good (a 4xx other than 429: retrying the same document cannot help)."""

    rejected: List[Any]

    @property
    def permanent(self) -> bool:
        return bool(self.rejected) and all(400 <= int(getattr(r, "status", 0)) < 500 and
                                           int(getattr(r, "status", 0)) != 429 for r in self.rejected)


class EventStore(ABC):
    @abstractmethod
    def put(self, events: Sequence[StoredEvent]) -> int:
        """Store events; duplicates (same event_id) are ignored. Returns how many were new."""

    @abstractmethod
    def get(self, project: str, event_id: str) -> Optional[StoredEvent]:
        """One event of ``project`` or None."""

    @abstractmethod
    def search(self, project: str, query: str, *, run_id: Optional[str] = None, limit: int = 50,
               cursor: Optional[str] = None) -> Page[SearchHit]:
        """Full-text search over ``text``: words are ANDed; "quoted phrases" match exactly; best first.
        Raises ValueError with a message for a query it cannot parse."""

    @abstractmethod
    def list_for_run(self, project: str, run_id: str, *, kinds: Optional[Sequence[str]] = None,
                     limit: int = 100, cursor: Optional[str] = None) -> Page[StoredEvent]:
        """A run's events, oldest first."""

    def sync(self) -> None:
        """Make every write so far durable. The processor calls it on each store before it commits queue
        offsets (processor/embedded.py): a store that defers the durability of its writes (SQLite with
        ``sync_at_checkpoint``: storage/sqlite.py) syncs them here; one whose writes are durable when they
        return has nothing to do (the default)."""

    def close(self) -> None:
        """Release resources."""


class OutOfFiles(RuntimeError):
    """A store could not open a file or a connection because this process is at its open-files limit
    (EMFILE / ENFILE: a burst of client connections holds the descriptors). Transient: the request may be
    retried once descriptors are given back -- servers answer it 503 + ``Retry-After`` (security.md H46),
    never 500, and nothing of the request is kept. ``reason``: the cause without the server's paths (what a
    client is told)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


class QueryTimeout(RuntimeError):
    """A read ran past the time budget of :meth:`MetricStore.time_budget` and was stopped."""


class MetricStore(ABC):
    @abstractmethod
    def put(self, points: Sequence[MetricPoint]) -> None:
        """Store points; a point with the same (project, run, rank, name, step) replaces the old one."""

    def put_columns(self, columns: MetricColumns) -> None:
        """:meth:`put` of a batch already grouped by series (what the processor writes). The default
        flattens it; stores with a cheaper columnar write override it."""
        if columns.count:
            self.put(list(columns.points()))

    def put_columns_many(self, batches: Sequence[MetricColumns]) -> None:
        """:meth:`put_columns` of each batch, in order (the processor's write-behind: several chunks'
        points at once); the stores end as after one ``put_columns`` per batch. The default writes them one
        by one; a store whose write has a per-transaction cost (SQLite) writes them in one."""
        for columns in batches:
            self.put_columns(columns)

    @abstractmethod
    def names(self, project: str, run_id: str) -> List[str]:
        """Metric names of a run, sorted."""

    @abstractmethod
    def series(self, project: str, run_id: str, names: Sequence[str], *, rank: Optional[int] = None,
               start_step: Optional[int] = None, end_step: Optional[int] = None,
               max_points: int = 1000) -> Dict[str, Dict[int, List[Bucket]]]:
        """``{name: {rank: buckets}}``: at most ``max_points`` buckets per (name, rank), equal step
        widths over the requested range; a bucket per step when the data is small enough."""

    @abstractmethod
    def summary(self, project: str, run_id: str) -> List[MetricSummary]:
        """Per-name aggregates over all ranks."""

    def summary_page(self, project: str, run_id: str, *, after: str = "",
                     limit: int = 1000) -> List[MetricSummary]:
        """:meth:`summary` of the run's first ``limit`` names (sorted) greater than ``after``: one page of it.
        The default filters the whole summary; stores with a name index read only the page."""
        return [s for s in self.summary(project, run_id) if s.name > after][:max(0, limit)]

    def series_keys(self, project: str, run_id: str, names: Sequence[str], *,
                    rank: Optional[int] = None) -> List[Tuple[str, int]]:
        """``(name, rank)`` of every stored series of the run among ``names`` (of ``rank`` only, if given),
        sorted: what a :meth:`series` call would return, to size it before running it. The default asks
        :meth:`series` for one bucket per series; stores with a series index answer from it."""
        found = self.series(project, run_id, names, rank=rank, max_points=1)
        return sorted((name, r) for name, by_rank in found.items() for r in by_rank)

    @contextmanager
    def time_budget(self, seconds: float) -> Iterator[None]:
        """Reads made by this thread inside the block (:meth:`series`, :meth:`summary`, :meth:`names`,
        :meth:`series_keys`) raise :class:`QueryTimeout` once the block has run ``seconds``. A store that
        cannot stop a read in progress ignores the budget (the default)."""
        yield

    def sync(self) -> None:
        """Make every write so far durable. The processor calls it on each store before it commits queue
        offsets (processor/embedded.py): a store that defers the durability of its writes (SQLite with
        ``sync_at_checkpoint``: storage/sqlite.py) syncs them here; one whose writes are durable when they
        return has nothing to do (the default)."""

    def close(self) -> None:
        """Release resources."""


@dataclass
class IncidentWorkflow:
    """What people did about an incident: acknowledged, resolved with a confirmed root cause, notes. Kept
    apart from the processor's record, so its upserts never overwrite it; the kind and fingerprint are
    copied in so that resolved incidents form a library ("how was this kind of failure solved before")."""

    project: str
    incident_id: str
    run_id: str = ""
    category: str = ""
    subtype: str = ""
    fingerprint: str = ""
    title: str = ""
    acknowledged_by: str = ""
    acknowledged_ns: int = 0
    resolved_by: str = ""
    resolved_ns: int = 0
    root_cause: str = ""
    notes: List[Dict[str, Any]] = field(default_factory=list)  # {"by", "time_ns", "text"}, oldest first

    def to_dict(self) -> Dict[str, Any]:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> IncidentWorkflow:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


class IncidentBrief(NamedTuple):
    """What a listing of many runs' incidents needs of each one, without its record (no document decoded)."""

    incident_id: str
    run_id: str
    status: str
    category: str
    subtype: str
    severity: str


class IncidentStore(ABC):
    """Runs, incidents, clusters, what people did about incidents, and the processor's state snapshots."""

    @abstractmethod
    def upsert_runs(self, runs: Sequence[RunRecord]) -> None: ...

    def upsert_records(self, runs: Sequence[RunRecord], incidents: Sequence[Incident],
                       clusters: Sequence[Cluster]) -> None:
        """:meth:`upsert_runs`, :meth:`upsert_incidents` and :meth:`upsert_clusters` of one processor round,
        in one transaction where the store can (SQLite: one commit); the default calls them in that order
        (each idempotent: a round that failed part-way is applied again whole)."""
        if runs:
            self.upsert_runs(runs)
        if incidents:
            self.upsert_incidents(incidents)
        if clusters:
            self.upsert_clusters(clusters)

    @abstractmethod
    def get_run(self, project: str, run_id: str) -> Optional[RunRecord]: ...

    @abstractmethod
    def list_runs(self, project: str, *, status: Optional[str] = None, tag: Optional[str] = None,
                  limit: int = 50, cursor: Optional[str] = None) -> Page[RunRecord]:
        """Most recently active first. ``tag`` is "key=value" or "key"."""

    @abstractmethod
    def upsert_incidents(self, incidents: Sequence[Incident]) -> None: ...

    @abstractmethod
    def get_incident(self, project: str, incident_id: str) -> Optional[Incident]: ...

    @abstractmethod
    def list_incidents(self, project: str, *, run_id: Optional[str] = None, status: Optional[str] = None,
                       limit: int = 50, cursor: Optional[str] = None) -> Page[Incident]:
        """Most recent first (by first_ns)."""

    def incident_briefs(self, project: str, run_ids: Sequence[str], *,
                        limit: int = 500) -> Dict[str, Optional[List[IncidentBrief]]]:
        """Each of ``run_ids``'s incidents as briefs, in :meth:`list_incidents` order (most recent first),
        in one read where the store can -- what the API uses to recount a page of runs; ``[]`` for a run
        without incidents, None for one with more than ``limit``. The default lists each run's incidents."""
        out: Dict[str, Optional[List[IncidentBrief]]] = {}
        for run_id in dict.fromkeys(run_ids):
            page = self.list_incidents(project, run_id=run_id, limit=limit)
            out[run_id] = None if page.next_cursor else [
                IncidentBrief(i.incident_id, i.run_id, i.status, i.category, i.subtype, i.severity)
                for i in page.items]
        return out

    @abstractmethod
    def upsert_clusters(self, clusters: Sequence[Cluster]) -> None: ...

    def merge_clusters(self, source: str, clusters: Sequence[Cluster]) -> None:
        """Merge one source's clusters into the stored ones, for N processors sharing a store: each record is
        ``source``'s own cumulative view (e.g. one queue partition's pipeline) and the stored cluster is the
        merge of every source's views -- counts summed over sources, first/last seen min/max, members united
        (capped), the earliest sample. Views of one source are joined too (count max, ...), so re-applying a
        view or an older one (a replay after a restore) changes nothing, and views applied in any order give
        one result (commutative, idempotent). The default replaces the records (:meth:`upsert_clusters`):
        right for a single source only; PostgreSQL keeps per-source views and merges."""
        self.upsert_clusters(clusters)

    @abstractmethod
    def get_cluster(self, project: str, fingerprint: str) -> Optional[Cluster]: ...

    @abstractmethod
    def list_clusters(self, project: str, *, limit: int = 50,
                      cursor: Optional[str] = None) -> Page[Cluster]:
        """Most recently seen first."""

    @abstractmethod
    def get_workflow(self, project: str, incident_id: str) -> Optional[IncidentWorkflow]: ...

    def get_workflows(self, project: str, incident_ids: Sequence[str]) -> Dict[str, IncidentWorkflow]:
        """``{incident_id: workflow}`` of those of ``incident_ids`` that have one (absent: none), in one read
        where the store can -- what the API uses to show a page of incidents or runs. The default asks
        :meth:`get_workflow` for each."""
        out: Dict[str, IncidentWorkflow] = {}
        for incident_id in dict.fromkeys(incident_ids):
            workflow = self.get_workflow(project, incident_id)
            if workflow is not None:
                out[incident_id] = workflow
        return out

    @abstractmethod
    def save_workflow(self, workflow: IncidentWorkflow) -> None: ...

    @abstractmethod
    def resolved_like(self, project: str, category: str, subtype: str, *,
                      limit: int = 20) -> List[IncidentWorkflow]:
        """Incidents of this kind resolved with a confirmed root cause, most recently resolved first."""

    def save_state(self, key: str, state: bytes) -> None:
        """Persist one state blob under ``key`` (:meth:`save_states` of one item)."""
        self.save_states({key: bytes(state)})

    @abstractmethod
    def save_states(self, items: Mapping[str, Optional[bytes]]) -> None:
        """Write every item in one atomic step: all of them or (on an exception) none. A ``None`` value
        deletes its key (absent keys are no error). What a processor's incremental snapshot uses."""

    @abstractmethod
    def load_state(self, key: str) -> Optional[bytes]: ...

    @abstractmethod
    def state_keys(self, prefix: str) -> List[str]:
        """The keys saved with ``save_state`` that start with ``prefix`` (literally: no wildcards), sorted."""

    def sync(self) -> None:
        """Make every write so far durable. The processor calls it on each store before it commits queue
        offsets (processor/embedded.py): a store that defers the durability of its writes (SQLite with
        ``sync_at_checkpoint``: storage/sqlite.py) syncs them here; one whose writes are durable when they
        return has nothing to do (the default)."""

    def close(self) -> None:
        """Release resources."""


@dataclass
class Project:
    name: str
    created_ns: int


@dataclass
class TokenInfo:
    token_id: str
    project: str
    kind: str                  # "ingest" | "read"
    created_ns: int
    revoked: bool = False
    description: str = ""
    expires_ns: int = 0        # 0: never

    def expired(self, now_ns: Optional[int] = None) -> bool:
        return bool(self.expires_ns) and self.expires_ns <= (time.time_ns() if now_ns is None else now_ns)


def format_ns(ns: int) -> str:
    """A time in ns as ISO 8601 UTC to the second (for messages)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ns / 1e9))


class ProjectStore(ABC):
    """Projects and their tokens. Tokens are stored hashed; the secret is shown once at creation."""

    @abstractmethod
    def create_token(self, project: str, kind: str, description: str = "", expires_ns: int = 0) -> str:
        """Create (and the project if new); returns the secret token text. ``expires_ns``: when it stops
        working (0: never)."""

    @abstractmethod
    def add_token(self, project: str, kind: str, token: str, description: str = "") -> TokenInfo:
        """Register a token text chosen by the operator (e.g. from TRAINGUARD_BOOTSTRAP_INGEST_TOKEN).
        Raises ValueError if the text is not a well-formed token or already exists."""

    @abstractmethod
    def lookup(self, token: str) -> Optional[TokenInfo]:
        """The token's info when the text is well formed and its secret matches, whatever its state
        (revoked, expired) -- to tell a caller why it is refused; None otherwise."""

    def authenticate(self, token: str) -> Optional[TokenInfo]:
        """The token's info if it exists, is not revoked and has not expired, else None."""
        info = self.lookup(token)
        return None if info is None or info.revoked or info.expired() else info

    def expired_at(self, token: str) -> int:
        """When a token that would otherwise be valid expired (ns), else 0: a refused token's reason."""
        info = self.lookup(token)
        return info.expires_ns if info is not None and not info.revoked and info.expired() else 0

    @abstractmethod
    def list_tokens(self, project: Optional[str] = None) -> List[TokenInfo]: ...

    @abstractmethod
    def revoke(self, token_id: str) -> bool: ...

    def close(self) -> None:
        """Release resources."""
