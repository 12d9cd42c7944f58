"""Runs, their metric series and their events."""

from __future__ import annotations

from dataclasses import asdict
from typing import List, Optional

from fastapi import APIRouter, HTTPException, Query

from ..deps import ProjectDep, ServicesDep
from ..schemas import (
    BucketPublic,
    EventPublic,
    IncidentPublic,
    MetricSeriesPublic,
    MetricSummaryPublic,
    PagePublic,
    RunPublic,
)
from .common import CursorQuery, LimitQuery, bad_request_on_value_error, not_found, wf

router = APIRouter(prefix="/api/v1/runs", tags=["runs"])

MAX_POINTS_LIMIT = 10_000
RUN_STATUSES = ("running", "finished", "failed", "stalled", "lost")


@router.get("", response_model=PagePublic[RunPublic], summary="Runs, most recently active first")
def list_runs(project: ProjectDep, services: ServicesDep,
              status: Optional[str] = Query(None, description="|".join(RUN_STATUSES)),
              tag: Optional[str] = Query(None, max_length=256, description="key=value or key"),
              limit: int = LimitQuery, cursor: Optional[str] = CursorQuery) -> PagePublic[RunPublic]:
    if status is not None and status not in RUN_STATUSES:
        raise HTTPException(400, f"status must be one of {', '.join(RUN_STATUSES)}")
    page = bad_request_on_value_error(
        lambda: services.incidents.list_runs(project, status=status, tag=tag, limit=limit, cursor=cursor))
    return PagePublic[RunPublic](items=[RunPublic(**r.to_dict()) for r in page.items],
                                 next_cursor=page.next_cursor)


@router.get("/{run_id}", response_model=RunPublic, responses={404: {"description": "no such run"}})
def get_run(run_id: str, project: ProjectDep, services: ServicesDep) -> RunPublic:
    run = services.incidents.get_run(project, run_id)
    if run is None:
        raise not_found("run", run_id)
    return RunPublic(**run.to_dict())


@router.get("/{run_id}/metrics", response_model=MetricSeriesPublic,
            summary="Downsampled series: min/max/mean per bucket, so spikes survive")
def run_metrics(run_id: str, project: ProjectDep, services: ServicesDep,
                names: Optional[str] = Query(None, max_length=4096,
                                             description="comma-separated; default: all"),
                rank: Optional[int] = Query(None, ge=0),
                start_step: Optional[int] = Query(None, ge=0),
                end_step: Optional[int] = Query(None, ge=0),
                max_points: int = Query(1000, ge=1, le=MAX_POINTS_LIMIT,
                                        description=f"buckets per series, 1..{MAX_POINTS_LIMIT}"),
                ) -> MetricSeriesPublic:
    if services.incidents.get_run(project, run_id) is None:
        raise not_found("run", run_id)
    if start_step is not None and end_step is not None and end_step < start_step:
        raise HTTPException(400, "end_step must be >= start_step")
    wanted: List[str] = ([n.strip() for n in names.split(",") if n.strip()] if names
                         else services.metrics.names(project, run_id))
    series = services.metrics.series(project, run_id, wanted, rank=rank, start_step=start_step,
                                     end_step=end_step, max_points=max_points)
    out = {name: {str(r): [BucketPublic(**{k: wf(v) for k, v in asdict(b).items()}) for b in buckets]
                  for r, buckets in by_rank.items()}
           for name, by_rank in series.items()}
    return MetricSeriesPublic(run_id=run_id, max_points=max_points, series=out)


@router.get("/{run_id}/metrics/summary", response_model=List[MetricSummaryPublic])
def run_metric_summary(run_id: str, project: ProjectDep, services: ServicesDep) -> List[MetricSummaryPublic]:
    if services.incidents.get_run(project, run_id) is None:
        raise not_found("run", run_id)
    return [MetricSummaryPublic(**{k: wf(v) for k, v in asdict(s).items()})
            for s in services.metrics.summary(project, run_id)]


@router.get("/{run_id}/incidents", response_model=PagePublic[IncidentPublic])
def run_incidents(run_id: str, project: ProjectDep, services: ServicesDep,
                  status: Optional[str] = Query(None, description="open | ongoing | resolved"),
                  limit: int = LimitQuery, cursor: Optional[str] = CursorQuery) -> PagePublic[IncidentPublic]:
    if services.incidents.get_run(project, run_id) is None:
        raise not_found("run", run_id)
    page = bad_request_on_value_error(lambda: services.incidents.list_incidents(
        project, run_id=run_id, status=status, limit=limit, cursor=cursor))
    return PagePublic[IncidentPublic](items=[IncidentPublic(**i.to_dict()) for i in page.items],
                                      next_cursor=page.next_cursor)


@router.get("/{run_id}/events", response_model=PagePublic[EventPublic],
            summary="Raw context of a run (exceptions, logs, lifecycle, alerts), oldest first")
def run_events(run_id: str, project: ProjectDep, services: ServicesDep,
               kinds: Optional[str] = Query(None, max_length=256, description="comma-separated kinds"),
               limit: int = LimitQuery, cursor: Optional[str] = CursorQuery) -> PagePublic[EventPublic]:
    if services.incidents.get_run(project, run_id) is None:
        raise not_found("run", run_id)
    kind_list = [k.strip() for k in kinds.split(",") if k.strip()] if kinds else None
    page = bad_request_on_value_error(lambda: services.events.list_for_run(
        project, run_id, kinds=kind_list, limit=limit, cursor=cursor))
    return PagePublic[EventPublic](items=[EventPublic(**asdict(e)) for e in page.items],
                                   next_cursor=page.next_cursor)
