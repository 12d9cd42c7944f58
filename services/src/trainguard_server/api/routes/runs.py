"""Runs, their metric series and their events.

Metric reads are bounded (issue 18, settings in ``config.py``) so heavy reads cannot crowd out ingest,
which shares the process and its thread pool:

* ``api_max_concurrent_queries`` metric reads (series, summary) run at once, at most
  ``api_max_concurrent_queries_per_project`` of them for one project; more wait for a slot -- on the event
  loop, holding no thread -- at most ``api_query_timeout_s``, then get 503 with ``Retry-After``. (Without the
  per-project bound, one project asking 8 at a time for the summary of a run with 200,000 metric names held
  every slot: another project's plain series read waited 7-10 s, or got 503);
* each read runs at most ``api_query_timeout_s`` (stores that can stop a read: SQLite), then 503;
* one ``/metrics`` answer holds at most ``api_max_metric_buckets`` buckets over all its series: the buckets
  per series are lowered to fit (the answer's ``max_points`` says how many were used), and a query of more
  series than that is refused with 400.
"""

from __future__ import annotations

import asyncio
import json
import re
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, TypeVar, Union
from urllib.parse import quote, urlencode

from fastapi import APIRouter, HTTPException, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from ...gateway.validate import PAYLOADS
from ...storage.base import Bucket, QueryTimeout
from ...storage.common import MAX_CURSOR_CHARS, decode_cursor, encode_cursor
from .. import resolutions
from ..deps import ProjectDep, Services, ServicesDep
from ..schemas import (
    EventPublic,
    IncidentPublic,
    MetricSeriesPublic,
    MetricSummaryPublic,
    PagePublic,
    RunPublic,
)
from .common import (
    CursorQuery,
    LimitQuery,
    bad_request_on_value_error,
    event_bytes,
    not_found,
    pages_within,
    wf,
)
from .incidents import STATUSES
from .stream import setting

router = APIRouter(prefix="/api/v1/runs", tags=["runs"])

MAX_POINTS_LIMIT = 10_000
RUN_STATUSES = ("running", "finished", "failed", "stalled", "lost")
#: an event's kind is its payload (the wire schema's ``Envelope.payload`` oneof; an alert is a metrics event)
EVENT_KINDS = PAYLOADS
INCIDENT_STATUSES = STATUSES
T = TypeVar("T")
_BOUNDED: Dict[Union[int, str], Dict[str, Any]] = {
    400: {"description": "a bad range, or more series than api_max_metric_buckets"},
    404: {"description": "no such run"},
    503: {"description": "no query slot within api_query_timeout_s, or the read ran past it (Retry-After)"}}


def _busy(services: Services, detail: str) -> HTTPException:
    retry = max(1, round(float(setting(services, "retry_after_s"))))
    return HTTPException(503, detail, headers={"Retry-After": str(retry)})


async def _acquire(slot: asyncio.Semaphore, wait: float) -> bool:
    try:
        await asyncio.wait_for(slot.acquire(), wait)
    except asyncio.TimeoutError:
        return False
    return True


@asynccontextmanager
async def query_slot(request: Request, services: Services, project: str = "") -> AsyncIterator[None]:
    """One of the app's ``api_max_concurrent_queries`` metric-read slots, and one of ``project``'s
    ``api_max_concurrent_queries_per_project``, waited for without a thread; 503 when none frees within
    ``api_query_timeout_s`` (both waits together)."""
    state = request.app.state
    slots: Optional[asyncio.Semaphore] = getattr(state, "metric_query_slots", None)
    if slots is None:
        slots = asyncio.Semaphore(int(setting(services, "api_max_concurrent_queries")))
        state.metric_query_slots = slots
    per_project: Optional[Dict[str, asyncio.Semaphore]] = getattr(state, "metric_query_project_slots", None)
    if per_project is None:
        per_project = state.metric_query_project_slots = {}
    mine = per_project.get(project)
    if mine is None:
        mine = per_project[project] = asyncio.Semaphore(
            int(setting(services, "api_max_concurrent_queries_per_project")))
    wait = float(setting(services, "api_query_timeout_s"))
    start = asyncio.get_running_loop().time()
    if not await _acquire(mine, wait):
        per = setting(services, "api_max_concurrent_queries_per_project")
        raise _busy(services, f"this project's metric query slots (api_max_concurrent_queries_per_project="
                              f"{per}) stayed busy for api_query_timeout_s={wait:g} s: retry later")
    try:
        if not await _acquire(slots, max(0.0, wait - (asyncio.get_running_loop().time() - start))):
            raise _busy(services, f"every metric query slot (api_max_concurrent_queries="
                                  f"{setting(services, 'api_max_concurrent_queries')}) stayed busy for "
                                  f"api_query_timeout_s={wait:g} s: retry later")
        try:
            yield
        finally:
            slots.release()
    finally:
        mine.release()


async def bounded_read(request: Request, services: Services, read: Callable[[], T], project: str = "") -> T:
    """``read()`` in a query slot (one of ``project``'s), on a worker thread, under the metric store's time
    budget."""
    budget = float(setting(services, "api_query_timeout_s"))

    def run() -> T:
        try:
            with services.metrics.time_budget(budget):
                return read()
        except QueryTimeout:
            raise _busy(services, f"the query ran past api_query_timeout_s={budget:g} s and was stopped: ask "
                                  f"for fewer names, one rank or a narrower start_step..end_step") from None

    async with query_slot(request, services, project):
        return await run_in_threadpool(run)


@router.get("", response_model=PagePublic[RunPublic], summary="Runs, most recently active first")
def list_runs(project: ProjectDep, services: ServicesDep,
              status: Optional[str] = Query(None, description="|".join(RUN_STATUSES)),
              tag: Optional[str] = Query(None, max_length=256, description="key=value or key"),
              limit: int = LimitQuery, cursor: Optional[str] = CursorQuery) -> PagePublic[RunPublic]:
    if status is not None and status not in RUN_STATUSES:
        raise HTTPException(400, f"status must be one of {', '.join(RUN_STATUSES)}")
    page = bad_request_on_value_error(
        lambda: services.incidents.list_runs(project, status=status, tag=tag, limit=limit, cursor=cursor))
    return PagePublic[RunPublic](items=[RunPublic(**r.to_dict())
                                        for r in resolutions.runs(services.incidents, page.items)],
                                 next_cursor=page.next_cursor)


@router.get("/{run_id}", response_model=RunPublic, responses={404: {"description": "no such run"}})
def get_run(run_id: str, project: ProjectDep, services: ServicesDep) -> RunPublic:
    run = services.incidents.get_run(project, run_id)
    if run is None:
        raise not_found("run", run_id)
    return RunPublic(**resolutions.run(services.incidents, run).to_dict())


NAMES_HELP = ("comma-separated, each stripped of white space at its ends; in a name, write a comma as \\, a "
              "backslash before a comma, a white-space character or a backslash as \\\\, and a white-space "
              "character at the name's start or end (a space, U+00A0, ...) with a backslash before it, as "
              "'\\ ' (any other backslash is itself); default: all")

_ESCAPED = frozenset(",\\")  # and every white-space character (str.isspace: what stripping removes)


def metric_name_list(names: str) -> List[str]:
    """The metric names a ``names`` parameter lists: split on commas, each name stripped of white space at its
    ends, empty names dropped -- as before stop 42 -- where a backslash before a comma, a white-space
    character (any that stripping removes: a space, U+00A0, U+3000, ...; before stop 43 only a space) or a
    backslash makes that character part of the name (``a\\,b`` is the name ``a,b``; ``\\ x`` the name
    `` x``; ``c\\\\`` the name ``c\\``) and any other backslash is itself (the SDK's escaped names,
    ``loss\\x1b``, are named as stored). A metric name may hold commas and spaces at its ends (security.md
    H31, H35): before, such a name could not be asked for at all."""
    out: List[str] = []
    chars: List[str] = []
    kept: List[bool] = []  # per character: escaped (never stripped)

    def end_name() -> None:
        lo, hi = 0, len(chars)
        while lo < hi and chars[lo].isspace() and not kept[lo]:
            lo += 1
        while hi > lo and chars[hi - 1].isspace() and not kept[hi - 1]:
            hi -= 1
        if hi > lo:
            out.append("".join(chars[lo:hi]))
        chars.clear()
        kept.clear()

    i = 0
    while i < len(names):
        c = names[i]
        if c == "\\" and i + 1 < len(names) and (names[i + 1] in _ESCAPED or names[i + 1].isspace()):
            chars.append(names[i + 1])
            kept.append(True)
            i += 2
            continue
        if c == ",":
            end_name()
        else:
            chars.append(c)
            kept.append(False)
        i += 1
    end_name()
    return out


@router.get("/{run_id}/metrics", response_model=MetricSeriesPublic, responses=_BOUNDED,
            summary="Downsampled series: min/max/mean per bucket, so spikes survive",
            description="At most api_max_metric_buckets buckets in all: with many series, fewer than "
                        "max_points each (the answer's max_points is the number used).")
async def run_metrics(run_id: str, request: Request, project: ProjectDep, services: ServicesDep,
                      names: Optional[str] = Query(None, max_length=4096, description=NAMES_HELP),
                      rank: Optional[int] = Query(None, ge=0),
                      start_step: Optional[int] = Query(None, ge=0),
                      end_step: Optional[int] = Query(None, ge=0),
                      max_points: int = Query(1000, ge=1, le=MAX_POINTS_LIMIT,
                                              description=f"buckets per series, 1..{MAX_POINTS_LIMIT}"),
                      ) -> Response:
    def read() -> Response:
        if services.incidents.get_run(project, run_id) is None:
            raise not_found("run", run_id)
        if start_step is not None and end_step is not None and end_step < start_step:
            raise HTTPException(400, "end_step must be >= start_step")
        wanted: List[str] = metric_name_list(names) if names else services.metrics.names(project, run_id)
        per_series = _points_per_series(services, project, run_id, wanted, rank, max_points)
        series = services.metrics.series(project, run_id, wanted, rank=rank, start_step=start_step,
                                         end_step=end_step, max_points=per_series)
        out = {name: {str(r): [_bucket(b) for b in buckets] for r, buckets in by_rank.items()}
               for name, by_rank in series.items()}
        return _json({"run_id": run_id, "max_points": per_series, "series": out})

    return await bounded_read(request, services, read, project)


def _bucket(b: Bucket) -> Dict[str, Any]:
    """A bucket as MetricSeriesPublic spells it (non-finite floats as strings)."""
    return {"step_start": b.step_start, "step_end": b.step_end, "count": b.count, "min": wf(b.min),
            "max": wf(b.max), "mean": wf(b.mean), "last": wf(b.last), "nonfinite": b.nonfinite}


def _json(body: Any) -> Response:
    """``body`` serialised once, as FastAPI would (a large answer is not validated and encoded again: the
    route builds exactly its response model's shape)."""
    return Response(json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(),
                    media_type="application/json")


def _points_per_series(services: Services, project: str, run_id: str, names: List[str],
                       rank: Optional[int], max_points: int) -> int:
    """``max_points``, lowered so that every series the query selects fits in ``api_max_metric_buckets``;
    HTTPException 400 when even one bucket each would not."""
    limit = int(setting(services, "api_max_metric_buckets"))
    unique = len(dict.fromkeys(names))
    if rank is not None and unique * max_points <= limit:
        return max_points  # one rank: at most one series per name, no need to count them
    count = len(services.metrics.series_keys(project, run_id, names, rank=rank))
    if count > limit:
        raise HTTPException(400, f"the query selects {count} series, more than api_max_metric_buckets="
                                 f"{limit} buckets in all: name fewer metrics (names=) or one rank (rank=)")
    return max(1, min(max_points, limit // max(1, count)))


SUMMARY_LIMIT = 1000
SUMMARY_MAX_LIMIT = 5000
_NEXT = {"X-Next-Cursor": {"description": "the cursor of the next page (absent on the last page)",
                           "schema": {"type": "string"}},
         "Link": {"description": "RFC 8288 link to the next page: <...>; rel=\"next\"",
                  "schema": {"type": "string"}}}


@router.get("/{run_id}/metrics/summary", response_model=List[MetricSummaryPublic],
            responses={**{k: v for k, v in _BOUNDED.items() if k != 400},
                       200: {"description": "one page of names, sorted", "headers": _NEXT},
                       400: {"description": "invalid cursor"}},
            summary="Per-name aggregates over all ranks, a page of names at a time",
            description=f"At most `limit` names ({SUMMARY_LIMIT} by default), sorted; when more follow, "
                        "the `X-Next-Cursor` header (and a `Link: <...>; rel=\"next\"`) gives the `cursor` "
                        "of the next page. The body stays a JSON array.")
async def run_metric_summary(run_id: str, request: Request, response: Response, project: ProjectDep,
                             services: ServicesDep,
                             limit: int = Query(SUMMARY_LIMIT, ge=1, le=SUMMARY_MAX_LIMIT,
                                                description=f"names per page, 1..{SUMMARY_MAX_LIMIT}"),
                             cursor: Optional[str] = Query(None, max_length=MAX_CURSOR_CHARS,
                                                           description="X-Next-Cursor of the previous page"),
                             ) -> List[MetricSummaryPublic]:
    scope = (project, run_id)
    after = bad_request_on_value_error(lambda: decode_cursor(cursor, "metric_summary", scope, (str,))[0]) \
        if cursor is not None else ""

    def read() -> List[MetricSummaryPublic]:
        if services.incidents.get_run(project, run_id) is None:
            raise not_found("run", run_id)
        page = services.metrics.summary_page(project, run_id, after=after, limit=limit + 1)
        if len(page) > limit:
            page = page[:limit]
            token = encode_cursor("metric_summary", scope, (page[-1].name,))
            response.headers["X-Next-Cursor"] = token
            # the path percent-encoded, as a header must be (a run id may be any text)
            path = quote(request.scope["path"], safe="/")
            response.headers["Link"] = f'<{path}?{urlencode({"limit": limit, "cursor": token})}>; rel="next"'
        return [MetricSummaryPublic(**{k: wf(v) for k, v in asdict(s).items()}) for s in page]

    return await bounded_read(request, services, read, project)


@router.get("/{run_id}/incidents", response_model=PagePublic[IncidentPublic])
def run_incidents(run_id: str, project: ProjectDep, services: ServicesDep,
                  status: Optional[str] = Query(None, description="open | ongoing | resolved"),
                  limit: int = LimitQuery, cursor: Optional[str] = CursorQuery) -> PagePublic[IncidentPublic]:
    if status is not None and status not in INCIDENT_STATUSES:  # as /api/v1/incidents: a typo is no filter
        raise HTTPException(400, f"status must be one of {', '.join(INCIDENT_STATUSES)}")
    if services.incidents.get_run(project, run_id) is None:
        raise not_found("run", run_id)
    page = bad_request_on_value_error(lambda: services.incidents.list_incidents(
        project, run_id=run_id, status=status, limit=limit, cursor=cursor))
    shown = resolutions.incidents(services.incidents, page.items, status)
    return PagePublic[IncidentPublic](items=[IncidentPublic(**i.to_dict()) for i in shown],
                                      next_cursor=page.next_cursor)


@router.get("/{run_id}/events", response_model=PagePublic[EventPublic],
            summary="Raw context of a run (exceptions, logs, lifecycle, alerts), oldest first")
def run_events(run_id: str, project: ProjectDep, services: ServicesDep,
               kinds: Optional[str] = Query(None, max_length=256, description="comma-separated kinds"),
               limit: int = LimitQuery, cursor: Optional[str] = CursorQuery) -> PagePublic[EventPublic]:
    kind_list = [k.strip() for k in kinds.split(",") if k.strip()] if kinds else None
    unknown = [k for k in kind_list or () if k not in EVENT_KINDS]
    if unknown:  # a typo must not read as "no such events"
        raise HTTPException(400, f"kinds: {unknown[0]!r} is not a kind of event; the kinds are "
                                 f"{', '.join(EVENT_KINDS)}")
    if services.incidents.get_run(project, run_id) is None:
        raise not_found("run", run_id)
    items, next_cursor = bad_request_on_value_error(lambda: pages_within(
        lambda n, at: services.events.list_for_run(project, run_id, kinds=kind_list, limit=n, cursor=at),
        limit, cursor, services.settings.api_max_page_bytes if services.settings else 0, event_bytes))
    return PagePublic[EventPublic](items=[EventPublic(**asdict(e)) for e in items], next_cursor=next_cursor)


@router.get("/{run_id}/events/{event_id}", response_model=EventPublic,
            responses={404: {"description": "no such event in this run of the project"}},
            summary="One event of a run by its id (an incident's evidence names its event ids)")
def run_event(run_id: str, event_id: str, project: ProjectDep, services: ServicesDep) -> EventPublic:
    """The event as the run's page of events gives it. An event of another run or project, or an id no
    event can have (longer than ``max_id_length`` or outside ``[0-9A-Za-z_-]``), answers 404 without a word
    more; the dashboard's traceback panel reads an incident's exception here, whatever page it is on."""
    max_id = setting(services, "max_id_length")
    if len(event_id) > max_id or not _EVENT_ID.fullmatch(event_id):
        raise not_found("event", event_id[:80])
    stored = services.events.get(project, event_id)
    if stored is None or stored.run_id != run_id:
        raise not_found("event", event_id)
    return EventPublic(**asdict(stored))


_EVENT_ID = re.compile(r"[0-9A-Za-z_-]+")

