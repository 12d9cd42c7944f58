"""Per-project quotas on the pipeline's state (issue 18, finding 2): one project cannot evict another's runs.

The pipeline keeps, per project, its runs in order of activity (least recently active first: the order in
which events newer than each run's latest arrived -- a replayed or late event changes no order, so replays
stay idempotent), its clusters in order of their last exception, how many incidents its
runs hold and the serialised size of its runs as of the last incremental checkpoint. The bounds
(:class:`~trainguard_engine.catalogue.DetectionSettings`, section ``state``):

* ``project_max_runs`` / ``project_max_clusters`` / ``project_max_incidents`` / ``project_max_state_bytes``:
  a project beyond one of them loses its *own* runs or clusters (the quota is "hit": counted in
  :attr:`ProjectIndex.hits`, which a runtime logs and exports);
* ``max_runs`` / ``max_clusters``: the whole pipeline's bounds; beyond them the project holding the most
  runs (clusters) loses one of its own -- a project with one live run is never the one evicted while
  another holds more.

A run evicted for a quota is chosen like any eviction: one of the project's ended runs among its
:data:`EVICTION_SCAN` least recently active, else its least recently active run. Its records stay in the
stores; its later events are dropped (``late``). Pure, no I/O; the orders are rebuilt from the runs' and
clusters' ``touched`` counts at a restore, so a restored pipeline evicts exactly as the original would.
"""

from __future__ import annotations

from typing import Dict, ItemsView, Iterable, Mapping, Optional, Tuple

from .state import ClusterState, RunState

EVICTION_SCAN = 64
"""Least recently active runs of a project searched for an ended one to evict first (a bound on the cost
of an eviction: a flood of new runs must not cost a scan of every run each)."""
QUOTA_HITS_MAX = 10_000
"""Most (project, quota) pairs :attr:`ProjectIndex.hits` counts separately; further projects count under
the project name ``"*"``."""
QUOTAS = ("runs", "clusters", "incidents", "state_bytes")


class ProjectIndex:
    """What the quotas need to know about each project, kept up to date by the pipeline."""

    def __init__(self) -> None:
        self.runs: Dict[str, Dict[str, None]] = {}      # project -> run keys, least recently active first
        self.clusters: Dict[str, Dict[str, None]] = {}  # project -> cluster keys, least recently seen first
        self.incidents: Dict[str, int] = {}             # project -> incidents held by its runs
        self.run_bytes: Dict[str, Tuple[str, int]] = {}  # run key -> (project, bytes at the last checkpoint)
        self.bytes: Dict[str, int] = {}                 # project -> sum of its runs' bytes
        self.hits: Dict[Tuple[str, str], int] = {}      # (project, quota) -> evictions it caused
        self.touched = 0                                # arrivals counted so far (the orders' clock)

    # --- runs -------------------------------------------------------------------------------------
    def touch_run(self, run: RunState, key: Optional[str] = None) -> None:
        """``run`` is new or got an event newer than any before: its project's most recently active run
        (``key``: its :attr:`~trainguard_engine.state.RunState.key`, when the caller has it). Pipeline._fold
        inlines the case of the project's latest run touched again: change both."""
        mine = self.runs.setdefault(run.project, {})
        if key is None:
            key = run.key
        if mine and next(reversed(mine)) != key:
            mine.pop(key, None)
        mine[key] = None
        self.touched += 1
        run.touched = self.touched

    def remove_run(self, run: RunState) -> None:
        mine = self.runs.get(run.project)
        if mine is not None:
            mine.pop(run.key, None)
            if not mine:
                del self.runs[run.project]
        self.add_incidents(run.project, -len(run.incidents))
        self.size_run(run.project, run.key, 0)

    def run_count(self, project: str) -> int:
        return len(self.runs.get(project, ()))

    def victim(self, project: str, runs: Mapping[str, RunState], keep: str = "") -> Optional[str]:
        """The run of ``project`` to evict (never ``keep``): an ended one among its EVICTION_SCAN least
        recently active, else its least recently active; None when it has no other run."""
        first: Optional[str] = None
        for i, key in enumerate(self.runs.get(project, ())):
            if key == keep:
                continue
            if first is None:
                first = key
            if runs[key].ended():
                return key
            if i >= EVICTION_SCAN:
                break
        return first

    def victim_with_incidents(self, project: str, runs: Mapping[str, RunState], keep: str) -> Optional[str]:
        """The least recently active run of ``project`` other than ``keep`` that holds incidents."""
        return next((k for k in self.runs.get(project, ()) if k != keep and runs[k].incidents), None)

    def largest(self, by_project: Mapping[str, Mapping[str, None]]) -> str:
        """The project holding the most entries of ``by_project`` (ties: the greater name)."""
        return max(by_project, key=lambda p: (len(by_project[p]), p))

    # --- clusters ---------------------------------------------------------------------------------
    def touch_cluster(self, project: str, key: str, cluster: ClusterState) -> None:
        mine = self.clusters.setdefault(project, {})
        mine.pop(key, None)
        mine[key] = None
        self.touched += 1
        cluster.touched = self.touched

    def remove_cluster(self, project: str, key: str) -> None:
        mine = self.clusters.get(project)
        if mine is not None:
            mine.pop(key, None)
            if not mine:
                del self.clusters[project]

    # --- incidents and bytes ----------------------------------------------------------------------
    def add_incidents(self, project: str, delta: int) -> None:
        if delta:
            self.incidents[project] = self.incidents.get(project, 0) + delta

    def size_run(self, project: str, key: str, nbytes: int) -> None:
        """Run ``key`` of ``project`` serialises to ``nbytes`` (0: gone)."""
        old = self.run_bytes.pop(key, None)
        total = self.bytes.get(project, 0) - (old[1] if old else 0) + nbytes
        if nbytes:
            self.run_bytes[key] = (project, nbytes)
        if total:
            self.bytes[project] = total
        else:
            self.bytes.pop(project, None)

    # --- accounting ---------------------------------------------------------------------------------
    def hit(self, project: str, quota: str) -> None:
        """Count ``project`` hitting ``quota`` (one of :data:`QUOTAS`)."""
        key = (project, quota)
        if key not in self.hits and len(self.hits) >= QUOTA_HITS_MAX:
            key = ("*", quota)
        self.hits[key] = self.hits.get(key, 0) + 1

    @classmethod
    def of_state(cls, runs: Mapping[str, RunState], clusters: Mapping[str, ClusterState]) -> ProjectIndex:
        """The index of a restored state (orders from the runs' and clusters' ``touched`` counts; sizes
        unknown until the next checkpoint measures them)."""
        index = cls()
        for key, run in sorted(runs.items(), key=lambda kv: (kv[1].touched, kv[0])):
            index.runs.setdefault(run.project, {})[key] = None
            index.add_incidents(run.project, len(run.incidents))
        for key, cluster in sorted(clusters.items(), key=lambda kv: (kv[1].touched, kv[0])):
            index.clusters.setdefault(cluster.record.project, {})[key] = None
        index.touched = max([r.touched for r in runs.values()] + [c.touched for c in clusters.values()] + [0])
        return index


class EvictedRuns:
    """The evicted runs the pipeline remembers (run key -> when evicted, ns), so that their late events are
    dropped rather than starting a new, partial record (``evicted_runs_remembered``, all projects together).

    Shared fairly (security.md H48): when full, a project holding more than its share (the bound over the
    projects remembered) forgets its own oldest entry, else the project holding the most forgets its
    oldest (ties: the greater name) -- never a smaller project's. Before, the oldest entry went whatever
    its project, so one project's flood of tens of thousands of run ids (each evicted within its own
    ``project_max_runs``) pushed every other project's evicted runs out of memory: a late or redelivered
    event of another project's finished run then started it again, as ``running``, and opened its
    incidents again. Iteration (snapshots) is in order of eviction, as before."""

    def __init__(self, items: Iterable[Tuple[str, int]] = ()) -> None:
        self.when: Dict[str, int] = {}
        self.by_project: Dict[str, Dict[str, None]] = {}  # project -> its keys, oldest first
        for key, t in items:
            self.when.pop(key, None)
            self.when[key] = t
        for key in self.when:
            self.by_project.setdefault(_project_of(key), {})[key] = None

    def __contains__(self, key: object) -> bool:
        return key in self.when

    def __len__(self) -> int:
        return len(self.when)

    def items(self) -> ItemsView[str, int]:
        return self.when.items()

    def put(self, key: str, t: int, most: int) -> None:
        """Remember run ``key`` evicted at ``t``; beyond ``most`` entries, forget as the class doc says."""
        project = _project_of(key)
        mine = self.by_project.setdefault(project, {})
        if key in self.when:
            del self.when[key]
            mine.pop(key, None)
        self.when[key] = t
        mine[key] = None
        while len(self.when) > most:
            over = project if len(mine) > max(1, most // len(self.by_project)) else \
                max(self.by_project, key=lambda p: (len(self.by_project[p]), p))
            theirs = self.by_project[over]
            oldest = next(iter(theirs))
            del theirs[oldest]
            del self.when[oldest]
            if not theirs:
                del self.by_project[over]


def _project_of(key: str) -> str:
    """The project of a run key (``project NUL run_id``, :func:`~trainguard_engine.state.run_key`)."""
    return key.partition("\x00")[0]
