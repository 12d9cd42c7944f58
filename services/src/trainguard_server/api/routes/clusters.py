"""Stack-fingerprint clusters: identical failures across runs, ranks and hosts."""

from __future__ import annotations

from typing import Optional

from fastapi import APIRouter

from ..deps import ProjectDep, ServicesDep
from ..schemas import ClusterPublic, PagePublic
from .common import CursorQuery, LimitQuery, bad_request_on_value_error, not_found

router = APIRouter(prefix="/api/v1/clusters", tags=["clusters"])


@router.get("", response_model=PagePublic[ClusterPublic], summary="Clusters, most recently seen first")
def list_clusters(project: ProjectDep, services: ServicesDep, limit: int = LimitQuery,
                  cursor: Optional[str] = CursorQuery) -> PagePublic[ClusterPublic]:
    page = bad_request_on_value_error(
        lambda: services.incidents.list_clusters(project, limit=limit, cursor=cursor))
    return PagePublic[ClusterPublic](items=[ClusterPublic(**c.to_dict()) for c in page.items],
                                     next_cursor=page.next_cursor)


@router.get("/{fingerprint}", response_model=ClusterPublic)
def get_cluster(fingerprint: str, project: ProjectDep, services: ServicesDep) -> ClusterPublic:
    cluster = services.incidents.get_cluster(project, fingerprint)
    if cluster is None:
        raise not_found("cluster", fingerprint)
    return ClusterPublic(**cluster.to_dict())
