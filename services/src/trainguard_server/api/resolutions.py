"""One incident status everywhere: a person's Resolve (``POST /api/v1/incidents/{id}/resolve``) is part of the
incident's status, and the run's health follows the status of its incidents (issue 22).

The processor owns the incident and run records and upserts them whenever they change; a resolution is stored
apart (:class:`~trainguard_server.storage.base.IncidentWorkflow`) so those upserts never lose it. So the API
applies it whenever it answers:

* an incident a person resolved is ``resolved`` (its ``resolved_ns`` the person's) whatever the processor's
  record says -- in the incident, the run's and the project's incident lists and the live run stream;
* a run's ``open_incidents`` and ``health`` count only the incidents still open after that (health:
  ``critical`` when one of severity error/critical is open, ``warning`` for warning, else ``healthy``, as the
  processor computes it), and a ``stalled`` run whose every stall a person resolved is ``running`` again;
* :func:`record_resolution` also writes the resolved status into the stored incident record at once, so that
  filtering incidents by status (``?status=resolved``) finds it until the processor next rewrites the record
  (filtering runs by status still goes by the processor's record: a run whose stalls a person resolved is
  listed under ``stalled`` and shown ``running``).

The processor's own resolution (the condition cleared) needs nothing here: its records already say so.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from trainguard_engine.records import Incident, RunRecord

from ..storage.base import IncidentBrief, IncidentStore

RESOLVED = "resolved"
OPEN_STATUSES = ("open", "ongoing")
SEVERITY_ORDER = {"info": 0, "warning": 1, "error": 2, "critical": 3}
STALL = ("progress", "stalled")
MAX_RUN_INCIDENTS = 500
"""Incidents of one run read to recount its open ones (a run with more keeps the processor's count)."""


def _resolved_ns(store: IncidentStore, project: str, incident_id: str) -> int:
    """When a person resolved the incident (0: nobody has)."""
    workflow = store.get_workflow(project, incident_id)
    return workflow.resolved_ns if workflow is not None else 0


def _resolved_by_person(store: IncidentStore,
                        wanted: Iterable[Tuple[str, str]]) -> Dict[Tuple[str, str], int]:
    """``{(project, incident_id): resolved_ns}`` of those of ``wanted`` a person resolved: one
    :meth:`~IncidentStore.get_workflows` read per project, however many incidents a page shows."""
    by_project: Dict[str, List[str]] = {}
    for project, incident_id in wanted:
        by_project.setdefault(project, []).append(incident_id)
    out: Dict[Tuple[str, str], int] = {}
    for project, ids in by_project.items():
        for incident_id, workflow in store.get_workflows(project, ids).items():
            if workflow.resolved_ns:
                out[(project, incident_id)] = workflow.resolved_ns
    return out


def _settled(record: Incident) -> bool:
    """Already resolved in the processor's record: nothing a person did can change how it shows."""
    return record.status == RESOLVED and bool(record.resolved_ns)


def _shown(record: Incident, resolved_ns: int) -> Incident:
    if not resolved_ns or _settled(record):
        return record
    return dataclasses.replace(record, status=RESOLVED, resolved_ns=record.resolved_ns or resolved_ns)


def incident(store: IncidentStore, record: Incident) -> Incident:
    """``record`` as the API shows it: ``resolved`` when a person resolved it (a copy; else ``record``)."""
    if _settled(record):
        return record
    return _shown(record, _resolved_ns(store, record.project, record.incident_id))


def incidents(store: IncidentStore, records: Sequence[Incident],
              status: Optional[str] = None) -> List[Incident]:
    """Each of ``records`` as :func:`incident` shows it (one workflow read for them all); with ``status``,
    those still of that status."""
    resolved = _resolved_by_person(store, ((r.project, r.incident_id) for r in records if not _settled(r)))
    shown = [_shown(r, resolved.get((r.project, r.incident_id), 0)) for r in records]
    return [r for r in shown if status is None or r.status == status]


def health_of(open_records: Sequence[Incident]) -> str:
    """The processor's rule: critical (an error/critical one open) > warning > healthy."""
    return _health([r.severity for r in open_records])


def _health(severities: Iterable[str]) -> str:
    worst = max((SEVERITY_ORDER.get(s, 0) for s in severities), default=-1)
    return "critical" if worst >= SEVERITY_ORDER["error"] else "warning" if worst == 1 else "healthy"


def run(store: IncidentStore, record: RunRecord) -> RunRecord:
    """``record`` with ``open_incidents``, ``health`` (and a ``stalled`` status) recounted from its incidents
    as :func:`incident` shows them, when a person resolved one of them (a copy; else ``record`` itself: the
    processor's figures stand)."""
    return runs(store, [record])[0]


def runs(store: IncidentStore, records: Sequence[RunRecord]) -> List[RunRecord]:
    """Each of ``records`` as :func:`run` shows it: one read of the incident briefs of the runs that have open
    incidents (:meth:`~IncidentStore.incident_briefs`, per project) and one workflow read for all their
    candidates -- not one incident listing per run and one workflow read per incident."""
    wanted: Dict[str, List[int]] = {}  # project -> indexes of the runs to recount
    for index, record in enumerate(records):
        if record.open_incidents > 0 or record.health != "healthy":
            wanted.setdefault(record.project, []).append(index)
    recount: List[Tuple[int, List[IncidentBrief], List[str]]] = []  # (index, stored open, candidate ids)
    for project, indexes in wanted.items():
        briefs = store.incident_briefs(project, [records[i].run_id for i in indexes], limit=MAX_RUN_INCIDENTS)
        for index in indexes:
            record = records[index]
            mine = briefs.get(record.run_id)
            if mine is None:  # more than MAX_RUN_INCIDENTS: the processor's figures stand
                continue
            stored_open = [i for i in mine if i.status in OPEN_STATUSES]
            # the open ones a person resolved; and when the processor counts more open than are stored open,
            # the stored resolved ones too (record_resolution wrote them before the processor's run record
            # caught up)
            candidates = [i.incident_id for i in (stored_open if len(stored_open) == record.open_incidents
                                                  else mine)]
            if candidates:
                recount.append((index, stored_open, candidates))
    resolved = _resolved_by_person(store, ((records[index].project, incident_id)
                                           for index, _, candidates in recount for incident_id in candidates))
    out = list(records)
    for index, stored_open, candidates in recount:
        record = records[index]
        by_person = {i for i in candidates if (record.project, i) in resolved}
        if not by_person:
            continue
        still_open = [i for i in stored_open if i.incident_id not in by_person]
        status = record.status
        if status == "stalled" and not any((i.category, i.subtype) == STALL for i in still_open):
            status = "running"
        out[index] = dataclasses.replace(record, open_incidents=len(still_open),
                                         health=_health(i.severity for i in still_open), status=status)
    return out


def record_resolution(store: IncidentStore, project: str, incident_id: str) -> None:
    """Write a person's resolution into the stored incident record now (see the module docstring)."""
    stored = store.get_incident(project, incident_id)
    if stored is None:
        return
    shown = incident(store, stored)
    if shown is not stored:
        store.upsert_incidents([shown])
    # the run record is not rewritten: the processor rewrites it every batch of a live run, and a copy written
    # here could land after (and undo) the processor's newer one; :func:`run` recounts it on every read
