"""Live updates of one run as server-sent events (``GET /api/v1/runs/{run_id}/stream``).

The stream reads the stores, not the processor, so it works wherever the API runs (``trainguard serve``, or
``trainguard api`` beside separate processors): every ``interval`` seconds it reads the run record and its
incidents and sends what changed since the last message --

* ``event: run`` with the run record (status, last step, last event, open incidents ...);
* ``event: incidents`` with the run's incident records, whole (the first message of a stream sends both);
* a ``: keep-alive`` comment every ``KEEPALIVE_S`` so proxies keep the connection open;
* ``event: error`` with ``{"status": 401, "detail": ...}``, and the end of the stream, once its token stops
  being valid: it expires (the stream ends at that time), or it is revoked (seen within
  ``api_stream_auth_recheck_s``, the setting, of the revocation).

It ends when the client goes away. Auth as every read endpoint (a read token in ``Authorization``; the
dashboard streams with ``fetch``, which can send it, rather than ``EventSource``, which cannot).

Streams cost a store read per stream per interval, so they are bounded (settings in ``config.py``): at most
``api_max_streams`` open in the app (one more: 503 with ``Retry-After``) and ``api_max_streams_per_token``
per read token (one more: 429), and ``interval`` is raised to at least ``api_stream_min_interval_s``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from typing import Any, AsyncIterator, Callable, Dict, List, Optional

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from ...config import Settings
from ...storage.base import ProjectStore, format_ns
from .. import resolutions
from ..deps import ProjectDep, ServicesDep
from ..schemas import IncidentPublic, RunPublic
from .common import not_found

router = APIRouter(prefix="/api/v1/runs", tags=["runs"])

KEEPALIVE_S = 15.0
MAX_INCIDENTS = 500


def _message(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _digest(data: Any) -> str:
    return hashlib.blake2b(json.dumps(data, sort_keys=True).encode(), digest_size=12).hexdigest()


def setting(services: Any, name: str) -> Any:
    """``name`` from the server's settings, or its documented default when the app was built without."""
    settings = getattr(services, "settings", None)
    return getattr(settings, name) if settings is not None else Settings.model_fields[name].default


def _bearer(request: Request) -> str:
    """The token text of ``Authorization: Bearer <token>`` (already checked by the read dependency)."""
    return (request.headers.get("authorization") or "").partition(" ")[2].strip()


class TokenWatch:
    """Whether a stream's read token is still valid: checked against the project store every
    ``recheck_s`` (a revocation), and at the moment it expires (known from the start)."""

    def __init__(self, projects: ProjectStore, token: str, project: str, recheck_s: float) -> None:
        self.projects, self.token, self.project, self.recheck_s = projects, token, project, recheck_s
        self.expires_at = float("inf")  # time.monotonic() at which the token expires
        self.next_check = time.monotonic() + recheck_s
        self.token_id = ""

    def start(self) -> None:
        """Learn the token's id and expiry (blocking; the read dependency has just accepted it)."""
        info = self.projects.authenticate(self.token)
        if info is not None:
            self.token_id = info.token_id
            if info.expires_ns:
                self.expires_at = time.monotonic() + (info.expires_ns - time.time_ns()) / 1e9

    def due_at(self) -> float:
        return min(self.next_check, self.expires_at)

    def check(self) -> Optional[str]:
        """None while the token still grants this project's reads (blocking), else the 401 detail."""
        self.next_check = time.monotonic() + self.recheck_s
        info = self.projects.authenticate(self.token)
        if info is not None and info.kind == "read" and info.project == self.project:
            return None
        expired = self.projects.expired_at(self.token)
        return f"token expired at {format_ns(expired)}: create a new one" if expired else \
            "unknown or revoked token"


class StreamSlots:
    """The live streams open in one app, in all and per token id. Used on the event loop's thread only."""

    def __init__(self, total: int, per_token: int) -> None:
        self.total, self.per_token = total, per_token
        self.open: Dict[str, int] = {}

    def take(self, token_id: str, retry_after_s: float) -> Callable[[], None]:
        """Count a stream in; the function that counts it out (once). HTTPException 429 / 503 when full."""
        if self.open.get(token_id, 0) >= self.per_token:
            raise HTTPException(429, f"{self.per_token} live streams are open for this token "
                                     f"(api_max_streams_per_token): close one first")
        if sum(self.open.values()) >= self.total:
            raise HTTPException(503, f"{self.total} live streams are open (api_max_streams): retry later",
                                headers={"Retry-After": str(max(1, round(retry_after_s)))})
        self.open[token_id] = self.open.get(token_id, 0) + 1
        done = False

        def give_back() -> None:
            nonlocal done
            if not done:
                done = True
                left = self.open[token_id] - 1
                if left:
                    self.open[token_id] = left
                else:
                    del self.open[token_id]
        return give_back


def _slots(request: Request, services: Any) -> StreamSlots:
    slots: Optional[StreamSlots] = getattr(request.app.state, "stream_slots", None)
    if slots is None:
        slots = StreamSlots(int(setting(services, "api_max_streams")),
                            int(setting(services, "api_max_streams_per_token")))
        request.app.state.stream_slots = slots
    return slots


class _CountedStream(StreamingResponse):
    """A streaming response that gives its stream slot back however the response ends."""

    def __init__(self, content: AsyncIterator[bytes], give_back: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.give_back = give_back

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.give_back()


@router.get("/{run_id}/stream", summary="Server-sent events: the run and its incidents as they change",
            response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}}}, 404: {"description": "no such run"},
                       429: {"description": "api_max_streams_per_token streams are open for this token"},
                       503: {"description": "api_max_streams streams are open (Retry-After)"}})
async def stream_run(run_id: str, request: Request, project: ProjectDep, services: ServicesDep,
                     interval: float = Query(1.0, ge=0.2, le=60.0, allow_inf_nan=False,
                                             description="seconds between checks "
                                             "(at least the server's api_stream_min_interval_s)")
                     ) -> StreamingResponse:
    interval = max(interval, float(setting(services, "api_stream_min_interval_s")))
    def read() -> Optional[Dict[str, Any]]:
        run = services.incidents.get_run(project, run_id)
        if run is None:
            return None
        page = services.incidents.list_incidents(project, run_id=run_id, limit=MAX_INCIDENTS)
        return {"run": RunPublic(**resolutions.run(services.incidents, run).to_dict()).model_dump(),
                "incidents": [IncidentPublic(**i.to_dict()).model_dump()
                              for i in resolutions.incidents(services.incidents, page.items)]}

    watch = TokenWatch(services.projects, _bearer(request), project,
                       float(setting(services, "api_stream_auth_recheck_s")))
    await run_in_threadpool(watch.start)
    give_back = _slots(request, services).take(watch.token_id, float(setting(services, "retry_after_s")))
    try:
        first = await run_in_threadpool(read)
    except BaseException:
        give_back()
        raise
    if first is None:
        give_back()
        raise not_found("run", run_id)

    async def events() -> AsyncIterator[bytes]:
        sent: Dict[str, str] = {}
        current: Optional[Dict[str, Any]] = first
        last_write = time.monotonic()
        next_read = last_write + interval
        while True:
            if current is not None:
                out: List[bytes] = []
                for key in ("run", "incidents"):
                    digest = _digest(current[key])
                    if sent.get(key) != digest:
                        sent[key] = digest
                        out.append(_message(key, current[key]))
                if out:
                    last_write = time.monotonic()
                    yield b"".join(out)
                current = None
            if time.monotonic() - last_write >= KEEPALIVE_S:
                last_write = time.monotonic()
                yield b": keep-alive\n\n"
            await asyncio.sleep(max(0.0, min(next_read, watch.due_at()) - time.monotonic()))
            if await request.is_disconnected():
                return
            if time.monotonic() >= watch.due_at():
                reason = await run_in_threadpool(watch.check)
                if reason is not None:
                    yield _message("error", {"status": 401, "detail": reason})
                    return
            if time.monotonic() >= next_read:
                next_read = time.monotonic() + interval
                current = await run_in_threadpool(read)

    return _CountedStream(events(), give_back, media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
