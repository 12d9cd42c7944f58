"""Full-text search over raw context: exception messages, tracebacks, log lines."""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional

from fastapi import APIRouter, Query

from ..deps import ProjectDep, ServicesDep
from ..schemas import EventPublic, PagePublic, SearchHitPublic
from .common import CursorQuery, LimitQuery, bad_request_on_value_error, event_bytes, pages_within

router = APIRouter(prefix="/api/v1/search", tags=["search"])


@router.get("", response_model=PagePublic[SearchHitPublic],
            summary='Words are ANDed, "quoted phrases" match exactly, tok* is a prefix')
def search(project: ProjectDep, services: ServicesDep,
           q: str = Query(..., min_length=1, max_length=512),
           run_id: Optional[str] = Query(None, max_length=256),
           limit: int = LimitQuery, cursor: Optional[str] = CursorQuery) -> PagePublic[SearchHitPublic]:
    hits, next_cursor = bad_request_on_value_error(lambda: pages_within(
        lambda n, at: services.events.search(project, q, run_id=run_id, limit=n, cursor=at),
        limit, cursor, services.settings.api_max_page_bytes if services.settings else 0,
        lambda hit: event_bytes(hit.event) + len(hit.snippet)))
    return PagePublic[SearchHitPublic](
        items=[SearchHitPublic(event=EventPublic(**asdict(h.event)), snippet=h.snippet, score=h.score)
               for h in hits],
        next_cursor=next_cursor)
