"""Incidents across a project, and one incident with its evidence and timeline."""

from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, HTTPException, Query

from .. import resolutions
from ..deps import ProjectDep, ServicesDep
from ..schemas import IncidentPublic, PagePublic
from .common import CursorQuery, LimitQuery, bad_request_on_value_error, not_found

router = APIRouter(prefix="/api/v1/incidents", tags=["incidents"])
STATUSES = ("open", "ongoing", "resolved")


@router.get("", response_model=PagePublic[IncidentPublic], summary="Incidents, most recent first")
def list_incidents(project: ProjectDep, services: ServicesDep,
                   status: Optional[str] = Query(None, description="open | ongoing | resolved"),
                   limit: int = LimitQuery,
                   cursor: Optional[str] = CursorQuery) -> PagePublic[IncidentPublic]:
    if status is not None and status not in STATUSES:
        raise HTTPException(400, f"status must be one of {', '.join(STATUSES)}")
    page = bad_request_on_value_error(
        lambda: services.incidents.list_incidents(project, status=status, limit=limit, cursor=cursor))
    shown = resolutions.incidents(services.incidents, page.items, status)
    return PagePublic[IncidentPublic](items=[IncidentPublic(**i.to_dict()) for i in shown],
                                      next_cursor=page.next_cursor)


@router.get("/{incident_id}", response_model=IncidentPublic,
            summary="One incident: evidence (rule, threshold, value, window) and timeline")
def get_incident(incident_id: str, project: ProjectDep, services: ServicesDep) -> IncidentPublic:
    incident = services.incidents.get_incident(project, incident_id)
    if incident is None:
        raise not_found("incident", incident_id)
    return IncidentPublic(**resolutions.incident(services.incidents, incident).to_dict())
