"""Full-text search over raw context: exception messages, tracebacks, log lines."""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional

from fastapi import APIRouter, Query

from ..deps import ProjectDep, ServicesDep
from ..schemas import EventPublic, PagePublic, SearchHitPublic
from .common import CursorQuery, LimitQuery, bad_request_on_value_error

router = APIRouter(prefix="/api/v1/search", tags=["search"])


@router.get("", response_model=PagePublic[SearchHitPublic],
            summary='Words are ANDed, "quoted phrases" match exactly, tok* is a prefix')
def search(project: ProjectDep, services: ServicesDep,
           q: str = Query(..., min_length=1, max_length=512),
           run_id: Optional[str] = Query(None, max_length=256),
           limit: int = LimitQuery, cursor: Optional[str] = CursorQuery) -> PagePublic[SearchHitPublic]:
    page = bad_request_on_value_error(
        lambda: services.events.search(project, q, run_id=run_id, limit=limit, cursor=cursor))
    return PagePublic[SearchHitPublic](
        items=[SearchHitPublic(event=EventPublic(**asdict(h.event)), snippet=h.snippet, score=h.score)
               for h in page.items],
        next_cursor=page.next_cursor)
