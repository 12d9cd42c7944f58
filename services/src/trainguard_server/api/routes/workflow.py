"""What people do about an incident: acknowledge it, resolve it with the root cause they confirmed, add
notes -- and the incident library those resolutions build ("how was this kind of failure solved before").

The workflow is stored apart from the processor's incident record (``IncidentStore.save_workflow``), so the
processor's upserts never overwrite it. The actions take the project's read token: whoever can look at a
project's incidents can annotate them (there is no finer role yet); ``by`` names who did it.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List

from fastapi import APIRouter
from pydantic import BaseModel, Field

from ...storage.base import IncidentWorkflow
from .. import resolutions
from ..deps import ProjectDep, ServicesDep
from ..preflight import ReadTokenFirstRoute
from .common import not_found

router = APIRouter(prefix="/api/v1/incidents", tags=["incident workflow"], route_class=ReadTokenFirstRoute)

MAX_NOTES = 200
SIMILAR = 10
LIBRARY = 200
"""Resolved incidents of one kind read for the similar list and the ranking of confirmed causes."""


class Actor(BaseModel):
    by: str = Field(..., min_length=1, max_length=200, description="who did it (a name or an e-mail)")


class Resolution(Actor):
    root_cause: str = Field(..., min_length=1, max_length=2000, description="the cause you confirmed")


class Note(Actor):
    text: str = Field(..., min_length=1, max_length=4000)


class WorkflowPublic(BaseModel):
    workflow: Dict[str, Any] = Field(description="acknowledged_by/_ns, resolved_by/_ns, root_cause, notes")
    similar: List[Dict[str, Any]] = Field(
        [], description="incidents of the same kind resolved with a confirmed root cause, the same stack "
                        "fingerprint first, then most recently resolved")
    confirmed_causes: List[Dict[str, Any]] = Field(
        [], description="the root causes confirmed for this kind of incident, ranked: how often (same stack "
                        "fingerprint counted first), then how recently -- {root_cause, count, "
                        "same_fingerprint, last_resolved_ns}")


def _load(project: str, incident_id: str, services: Any) -> IncidentWorkflow:
    incident = services.incidents.get_incident(project, incident_id)
    if incident is None:
        raise not_found("incident", incident_id)
    found = services.incidents.get_workflow(project, incident_id)
    workflow = found or IncidentWorkflow(project=project, incident_id=incident_id)
    # the kind, fingerprint and title as the processor knows them now (correlation may relabel an incident)
    workflow.run_id, workflow.category = incident.run_id, incident.category
    workflow.subtype = incident.subtype
    workflow.fingerprint, workflow.title = incident.fingerprint, incident.title
    return workflow


def ranked_causes(library: List[IncidentWorkflow], fingerprint: str) -> List[Dict[str, Any]]:
    """Confirmed root causes of one kind, merged by their text (case and spacing ignored) and ranked: the
    same stack fingerprint's first, then by how often, then by how recently."""
    merged: Dict[str, Dict[str, Any]] = {}
    for w in library:
        key = " ".join(w.root_cause.lower().split())
        entry = merged.setdefault(key, {"root_cause": w.root_cause, "count": 0, "same_fingerprint": 0,
                                        "last_resolved_ns": 0})
        entry["count"] += 1
        entry["same_fingerprint"] += int(bool(fingerprint) and w.fingerprint == fingerprint)
        entry["last_resolved_ns"] = max(entry["last_resolved_ns"], w.resolved_ns)
    return sorted(merged.values(),
                  key=lambda e: (-e["same_fingerprint"], -e["count"], -e["last_resolved_ns"]))


def _public(workflow: IncidentWorkflow, services: Any) -> WorkflowPublic:
    library = [w for w in services.incidents.resolved_like(workflow.project, workflow.category,
                                                           workflow.subtype, limit=LIBRARY)
               if w.incident_id != workflow.incident_id]
    similar = list(library)
    similar.sort(key=lambda w: (w.fingerprint != workflow.fingerprint or not w.fingerprint, -w.resolved_ns))
    return WorkflowPublic(workflow=workflow.to_dict(), similar=[
        {k: w.to_dict()[k] for k in ("incident_id", "run_id", "title", "fingerprint", "root_cause",
                                     "resolved_by", "resolved_ns")} for w in similar[:SIMILAR]],
        confirmed_causes=ranked_causes(library, workflow.fingerprint)[:SIMILAR])


@router.get("/{incident_id}/workflow", response_model=WorkflowPublic,
            summary="Who acknowledged / resolved it, its confirmed root cause, notes; similar resolved ones")
def get_workflow(incident_id: str, project: ProjectDep, services: ServicesDep) -> WorkflowPublic:
    return _public(_load(project, incident_id, services), services)


@router.post("/{incident_id}/acknowledge", response_model=WorkflowPublic, summary="Someone is on it")
def acknowledge(incident_id: str, body: Actor, project: ProjectDep, services: ServicesDep) -> WorkflowPublic:
    workflow = _load(project, incident_id, services)
    if not workflow.acknowledged_ns:
        workflow.acknowledged_by, workflow.acknowledged_ns = body.by, time.time_ns()
    services.incidents.save_workflow(workflow)
    return _public(workflow, services)


@router.post("/{incident_id}/resolve", response_model=WorkflowPublic,
             summary="Resolved, with the root cause you confirmed (it joins the incident library)")
def resolve(incident_id: str, body: Resolution, project: ProjectDep,
            services: ServicesDep) -> WorkflowPublic:
    workflow = _load(project, incident_id, services)
    workflow.resolved_by, workflow.resolved_ns, workflow.root_cause = body.by, time.time_ns(), body.root_cause
    if not workflow.acknowledged_ns:
        workflow.acknowledged_by, workflow.acknowledged_ns = body.by, workflow.resolved_ns
    services.incidents.save_workflow(workflow)
    resolutions.record_resolution(services.incidents, project, incident_id)  # one status everywhere
    return _public(workflow, services)


@router.post("/{incident_id}/notes", response_model=WorkflowPublic, summary="Add a note")
def add_note(incident_id: str, body: Note, project: ProjectDep, services: ServicesDep) -> WorkflowPublic:
    workflow = _load(project, incident_id, services)
    note = {"by": body.by, "time_ns": time.time_ns(), "text": body.text}
    workflow.notes = [*workflow.notes, note][-MAX_NOTES:]
    services.incidents.save_workflow(workflow)
    return _public(workflow, services)
