"""Live updates of one run as server-sent events (``GET /api/v1/runs/{run_id}/stream``).

The stream reads the stores, not the processor, so it works wherever the API runs (``trainguard serve``, or
``trainguard api`` beside separate processors): every ``interval`` seconds it reads the run record and its
incidents and sends what changed since the last message --

* ``event: run`` with the run record (status, last step, last event, open incidents ...);
* ``event: incidents`` with the run's incident records, whole (the first message of a stream sends both);
* a ``: keep-alive`` comment every ``KEEPALIVE_S`` so proxies keep the connection open.

It ends when the client goes away. Auth as every read endpoint (a read token in ``Authorization``; the
dashboard streams with ``fetch``, which can send it, rather than ``EventSource``, which cannot).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from typing import Any, AsyncIterator, Dict, List, Optional

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

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


@router.get("/{run_id}/stream", summary="Server-sent events: the run and its incidents as they change",
            response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}}}, 404: {"description": "no such run"}})
async def stream_run(run_id: str, request: Request, project: ProjectDep, services: ServicesDep,
                     interval: float = Query(1.0, ge=0.2, le=60.0, description="seconds between checks")
                     ) -> StreamingResponse:
    def read() -> Optional[Dict[str, Any]]:
        run = services.incidents.get_run(project, run_id)
        if run is None:
            return None
        page = services.incidents.list_incidents(project, run_id=run_id, limit=MAX_INCIDENTS)
        return {"run": RunPublic(**run.to_dict()).model_dump(),
                "incidents": [IncidentPublic(**i.to_dict()).model_dump() for i in page.items]}

    first = await run_in_threadpool(read)
    if first is None:
        raise not_found("run", run_id)

    async def events() -> AsyncIterator[bytes]:
        sent: Dict[str, str] = {}
        current: Optional[Dict[str, Any]] = first
        last_write = time.monotonic()
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
            if time.monotonic() - last_write >= KEEPALIVE_S:
                last_write = time.monotonic()
                yield b": keep-alive\n\n"
            await asyncio.sleep(interval)
            if await request.is_disconnected():
                return
            current = await run_in_threadpool(read)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
