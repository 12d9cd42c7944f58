"""Reading what the gate compares out of the stores (I/O): runs, one rank's metric series, incidents and
the stack fingerprints of captured exceptions.

The API route and ``trainguard gate --data-dir`` both read through :class:`StoreReader` (the CLI with
``--api`` asks the server, which reads the same way), so the comparison always sees the same data.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from trainguard_engine.clusters import identify

from ..storage.base import EventStore, IncidentStore, MetricStore
from .profile import IncidentBrief, RunData, Series

PAGE = 500
MAX_POINTS = 10_000
"""Buckets per series: every step of runs up to 10,000 steps; longer runs are bucketed (bucket means)."""
MAX_RUNS = 200
"""The most runs a baseline defined by tag may hold (the most recently active ones)."""


class StoreReader:
    """The gate's view of one project's stores."""

    def __init__(self, incidents: IncidentStore, metrics: MetricStore, events: EventStore,
                 project: str) -> None:
        self.incidents = incidents
        self.metrics = metrics
        self.events = events
        self.project = project

    def status(self, run_id: str) -> Optional[str]:
        run = self.incidents.get_run(self.project, run_id)
        return run.status if run is not None else None

    def runs_with_tag(self, tag: str, limit: int = MAX_RUNS) -> List[str]:
        """Ids of the runs carrying ``tag`` ("key=value" or "key"), most recently active first."""
        pages = _paged(lambda cursor: self.incidents.list_runs(self.project, tag=tag, limit=min(PAGE, limit),
                                                               cursor=cursor))
        return [r.run_id for r in itertools.islice(pages, limit)]

    def _incidents(self, run_id: str) -> Iterator[Any]:
        return _paged(lambda cursor: self.incidents.list_incidents(self.project, run_id=run_id, limit=PAGE,
                                                                   cursor=cursor))

    def _exceptions(self, run_id: str) -> Iterator[Any]:
        return _paged(lambda cursor: self.events.list_for_run(self.project, run_id, kinds=["exception"],
                                                              limit=PAGE, cursor=cursor))

    def run_data(self, run_id: str, metrics: Sequence[str]) -> Optional[RunData]:
        """Everything the gate uses of one run (None when the project has no such run): the record, the
        ``metrics``' series of the lowest rank that reports each (bucket means at bucket centres, NaN for
        a bucket of only non-finite values) and their maximum over all ranks, incidents (consequences
        folded into another incident left out), and every fingerprint its exceptions had."""
        record = self.incidents.get_run(self.project, run_id)
        if record is None:
            return None
        series: Dict[str, Series] = {}
        peaks: Dict[str, float] = {}
        wanted = [m for m in dict.fromkeys(metrics) if m]
        for name, by_rank in self.metrics.series(self.project, run_id, wanted, max_points=MAX_POINTS).items():
            if not by_rank:
                continue
            buckets = by_rank[min(by_rank)]
            series[name] = [((b.step_start + b.step_end) / 2.0, _bucket_value(b)) for b in buckets]
            maxima = [b.max for bs in by_rank.values() for b in bs if math.isfinite(b.max)]
            if maxima:
                peaks[name] = max(maxima)
        incidents = [IncidentBrief(kind=f"{i.category}/{i.subtype}", severity=i.severity,
                                   fingerprint=i.fingerprint, first_step=i.first_step, title=i.title)
                     for i in self._incidents(run_id) if not i.explained_by]
        fingerprints: Dict[str, str] = {}
        for event in self._exceptions(run_id):
            body = event.payload.get("exception") if isinstance(event.payload, dict) else None
            if not isinstance(body, dict):
                continue
            fp, _version, exc_type, template = identify(body)
            fingerprints.setdefault(fp, f"{exc_type}: {template}" if template else exc_type)
        return RunData(run_id=run_id, status=record.status, last_step=record.last_step,
                       tags=dict(record.tags), series=series, peaks=peaks, incidents=incidents,
                       fingerprints=fingerprints)


def _paged(fetch: Callable[[Optional[str]], Any]) -> Iterator[Any]:
    """Every item of a cursor-paginated listing: ``fetch(cursor)`` returns a page (``items``,
    ``next_cursor``), the first with cursor None."""
    cursor: Optional[str] = None
    while True:
        page = fetch(cursor)
        yield from page.items
        cursor = page.next_cursor
        if not cursor:
            return


def _bucket_value(bucket: Any) -> float:
    """A bucket's mean; +inf when every value in it was non-finite (the gate treats NaN as infinitely bad,
    and a bucket with some non-finite values keeps its finite mean only if most were finite)."""
    if bucket.nonfinite and (bucket.count - bucket.nonfinite) < bucket.nonfinite:
        return math.inf
    mean = float(bucket.mean)
    return mean if math.isfinite(mean) else math.inf
