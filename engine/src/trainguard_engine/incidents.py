"""Incident lifecycle: fold detector findings into a run's incidents, and resolve them.

A detector never builds an :class:`~trainguard_engine.records.Incident`; it returns a :class:`Finding`
("this kind, in this slot of the run, on this rank, at this step, because of this evidence") and
:func:`apply` does the bookkeeping every kind shares:

* **open** on the first finding of a slot: id, severity, title template and checklist from the
  catalogue; ``incident_id`` hashes the kind *at open* and the slot key, so the id never changes even when
  the incident is re-classified later (``loss/non_finite`` → ``gradient/explosion``);
* **ongoing** when a later finding adds a signal or evidence; a finding for a resolved incident reopens
  it;
* ranks and hosts merged (bounded); ``lead_rank`` = the rank with the earliest signal (event time, then
  rank number); ``first_step``/``last_step`` and ``first_ns``/``last_ns`` the extremes over all findings;
* evidence and timeline bounded by ``max_evidence``/``max_timeline`` (the middle goes first); the timeline
  is kept in event-time order;
* ``count`` = the distinct signals folded in (findings with ``counts=True``; duplicates never get here).

:func:`resolve` closes an incident whose condition cleared. Both mark the state dirty for the output and
count the change (:attr:`~trainguard_engine.state.RunState.changes`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, List, Mapping, Optional, Sequence

from .catalogue import DetectionSettings, kind
from .records import (
    INCIDENT_ONGOING,
    INCIDENT_OPEN,
    INCIDENT_RESOLVED,
    SEVERITY_ORDER,
    Evidence,
    Incident,
    TimelineEntry,
    incident_id,
)
from .state import IncidentState, RunState, bounded_append


@dataclass
class Finding:
    """What a detector saw. ``key`` is the incident's slot within the run (findings with one key fold
    into one incident). ``step`` is where the condition began as this finding knows it (-1: unknown);
    ``time_ns`` when it began (the lead rank is the one with the earliest); ``seen_ns``/``seen_step``
    when it was observed, if later (an explosion begins before the loss goes NaN; a stall begins at the
    last progress and is seen at a heartbeat)."""

    category: str
    subtype: str
    key: str
    rank: int
    step: int
    time_ns: int
    host: str = ""
    seen_ns: int = 0             # when the condition was (last) observed, if later than time_ns
    seen_step: int = -1          # the step at which it was observed, if later than step
    event_id: str = ""
    evidence: Sequence[Evidence] = ()
    timeline: Sequence[TimelineEntry] = ()
    values: Mapping[str, Any] = field(default_factory=dict)  # title placeholders
    summary: str = ""
    fingerprint: str = ""
    counts: bool = True          # a new signal: Incident.count += 1
    relabel: bool = False        # may change the kind of an existing incident
    replace_evidence: bool = False  # replace evidence of the same (rule, rank) instead of appending
    update_values: bool = False  # refresh the title placeholders of an existing incident
    severity: str = ""           # overrides the kind's severity (a rule with levels); only ever raises it
    provisional: bool = False    # a relayed report: the first direct one replaces its title and summary


def apply(run: RunState, finding: Finding, settings: DetectionSettings) -> Optional[IncidentState]:
    """Fold ``finding`` into ``run``'s incidents; returns the incident, or None when the run already has
    ``max_incidents_per_run`` incidents (the finding is dropped; the caller counts it)."""
    st = run.incidents.get(finding.key)
    if st is None:
        if len(run.incidents) >= settings.max_incidents_per_run:
            return None
        st = _open(run, finding)
    else:
        _fold(st, finding)
        if finding.counts:
            st.record.count += 1
    inc = st.record
    _merge_members(st, finding, settings)
    for ev in finding.evidence:
        _add_evidence(inc, ev, finding.replace_evidence, settings)
    for entry in finding.timeline:
        add_timeline(inc, entry, settings)
    if finding.fingerprint and not inc.fingerprint:
        inc.fingerprint = finding.fingerprint
    _render(st)
    st.dirty = True
    st.changed()
    return st


def _open(run: RunState, finding: Finding) -> IncidentState:
    spec = kind(finding.category, finding.subtype)
    inc = Incident(
        incident_id=incident_id(run.project, run.run_id, finding.category, finding.subtype, finding.key),
        project=run.project, run_id=run.run_id, category=finding.category, subtype=finding.subtype,
        severity=finding.severity or spec.severity, status=INCIDENT_OPEN,
        summary=finding.summary or spec.description,
        first_ns=finding.time_ns, last_ns=max(finding.time_ns, finding.seen_ns),
        fingerprint=finding.fingerprint, checks=spec.checklist(), count=1 if finding.counts else 0)
    st = IncidentState(key=finding.key, record=inc, values=dict(finding.values), changes=run.changes)
    if finding.provisional:
        st.extra["provisional"] = True
    run.incidents[finding.key] = st
    return st


def _fold(st: IncidentState, finding: Finding) -> None:
    inc = st.record
    if inc.status == INCIDENT_RESOLVED:
        inc.status, inc.resolved_ns = INCIDENT_ONGOING, 0
    elif finding.counts or finding.evidence:
        inc.status = INCIDENT_ONGOING
    if finding.relabel and (finding.category, finding.subtype) != (inc.category, inc.subtype):
        spec = kind(finding.category, finding.subtype)
        inc.category, inc.subtype, inc.severity = finding.category, finding.subtype, spec.severity
        inc.checks = spec.checklist()
        inc.summary = finding.summary or spec.description
        st.values.update(finding.values)
    elif finding.update_values:
        st.values.update(finding.values)
    elif st.extra.get("provisional") and not finding.provisional and finding.values and \
            (finding.category, finding.subtype) == (inc.category, inc.subtype):
        del st.extra["provisional"]  # a direct report of what a relayed one opened the incident with
        st.values.update(finding.values)
        inc.summary = finding.summary or inc.summary
    if finding.severity and SEVERITY_ORDER.get(finding.severity, 0) > SEVERITY_ORDER.get(inc.severity, 0):
        inc.severity = finding.severity


def _merge_members(st: IncidentState, finding: Finding, settings: DetectionSettings) -> None:
    inc = st.record
    if finding.rank >= 0:
        first = st.rank_first.get(finding.rank)
        if first is None and len(st.rank_first) >= settings.max_incident_ranks:
            pass  # listed ranks are bounded; the signal still counts
        elif first is None or (finding.time_ns, finding.step) < first:
            st.rank_first[finding.rank] = (finding.time_ns, finding.step)
        refresh_ranks(st)
    if finding.host and finding.host not in inc.hosts and len(inc.hosts) < settings.max_incident_ranks:
        inc.hosts.append(finding.host)
    if finding.time_ns:
        inc.first_ns = min(inc.first_ns, finding.time_ns) if inc.first_ns else finding.time_ns
    inc.last_ns = max(inc.last_ns, finding.time_ns, finding.seen_ns)
    if finding.step >= 0:
        inc.first_step = finding.step if inc.first_step < 0 else min(inc.first_step, finding.step)
    inc.last_step = max(inc.last_step, finding.step, finding.seen_step)


def refresh_ranks(st: IncidentState) -> None:
    """``ranks`` and ``lead_rank`` from ``st.rank_first``: the lead is the rank correlation pinned
    (``st.extra["lead"]``: a lagging rank, the rank whose loss went non-finite first) if it is listed,
    else the rank with the earliest signal (event time, then rank number)."""
    if not st.rank_first:
        return
    inc = st.record
    inc.ranks = sorted(st.rank_first)
    pinned = st.extra.get("lead")
    if isinstance(pinned, int) and pinned in st.rank_first:
        inc.lead_rank = pinned
    else:
        inc.lead_rank = min(st.rank_first, key=lambda r: (st.rank_first[r][0], r))


def _add_evidence(inc: Incident, ev: Evidence, replace: bool, settings: DetectionSettings) -> None:
    if replace:
        for i, old in enumerate(inc.evidence):
            if old.rule == ev.rule and old.rank == ev.rank:
                inc.evidence[i] = ev
                return
    bounded_append(inc.evidence, ev, settings.max_evidence)


def add_timeline(inc: Incident, entry: TimelineEntry, settings: DetectionSettings) -> None:
    """Insert ``entry`` in event-time order (ties keep arrival order), bounded."""
    times = [t.time_ns for t in inc.timeline]
    index = bisect.bisect_right(times, entry.time_ns)
    inc.timeline.insert(index, entry)
    while len(inc.timeline) > settings.max_timeline:
        del inc.timeline[settings.max_timeline // 2]


def _render(st: IncidentState) -> None:
    spec = kind(st.record.category, st.record.subtype)
    st.record.title = spec.render_title(st.values)


def resolve(st: IncidentState, time_ns: int, step: int, rank: int, what: str,
            settings: DetectionSettings) -> None:
    """The condition cleared: status resolved at ``time_ns``, with a timeline entry saying why."""
    inc = st.record
    if inc.status == INCIDENT_RESOLVED:
        return
    inc.status, inc.resolved_ns = INCIDENT_RESOLVED, time_ns
    add_timeline(inc, TimelineEntry(time_ns=time_ns, step=step, rank=rank, what=what), settings)
    st.dirty = True
    st.changed()


def open_incidents(run: RunState) -> List[IncidentState]:
    """The run's incidents that are not resolved, in opening order."""
    return [st for st in run.incidents.values() if st.is_open]


def worst_severity(states: Sequence[IncidentState]) -> str:
    """The highest severity among ``states`` ("" when empty)."""
    worst = ""
    for st in states:
        if not worst or SEVERITY_ORDER.get(st.record.severity, 0) > SEVERITY_ORDER.get(worst, 0):
            worst = st.record.severity
    return worst
