"""How many query-API requests one project may have in flight, so one project's readers cannot starve
another's: every request shares one process, its thread pool and its interpreter, and 80 clients of one
project listing and searching at once raised another project's read and ingest latency from ~0.01-0.04 s
to 0.3-2.5 s.

Contract:

* A request that needs a read token (every ``/api/v1`` route but a run's live stream, which has its own
  bounds, ``api_max_streams_per_token``) takes one of its project's ``api_max_requests_per_project`` slots
  after its token is checked (:mod:`.preflight`) and gives it back once its response is sent
  (:class:`ReleaseProjectSlot`, whatever the outcome).
* With every slot of its project taken, a request waits for one on the event loop -- holding no thread --
  at most ``api_request_wait_s``, then is answered 429 with ``Retry-After`` (``retry_after_s``) and a
  message naming the project, the bound and the setting. Other projects' requests never wait for it.
* ``api_max_requests_per_project = 0`` turns the bound off. Per API process.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any, Awaitable, Callable, Dict, MutableMapping

from fastapi import HTTPException
from starlette.requests import Request

from .routes.stream import setting

__all__ = ["AnswerStalled", "ProjectSlots", "ReleaseProjectSlot", "take_slot"]

log = logging.getLogger(__name__)

SETTING = "TRAINGUARD_API_MAX_REQUESTS_PER_PROJECT"
_STATE_KEY = "trainguard_project_slot"  # in the request's scope state: the project whose slot it holds


class ProjectSlots:
    """Per-project semaphores of the event loop (used from the loop only: no lock)."""

    def __init__(self, limit: int, wait_s: float) -> None:
        self.limit = limit
        self.wait_s = wait_s
        self._slots: Dict[str, asyncio.Semaphore] = {}

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    async def acquire(self, project: str) -> bool:
        """True once one of ``project``'s slots is taken; False when none freed within ``wait_s``."""
        slot = self._slots.get(project)
        if slot is None:
            slot = self._slots[project] = asyncio.Semaphore(self.limit)
        if not slot.locked():
            await slot.acquire()
            return True
        try:
            await asyncio.wait_for(slot.acquire(), self.wait_s)
        except asyncio.TimeoutError:
            return False
        return True

    def release(self, project: str) -> None:
        self._slots[project].release()


def _slots(request: Request) -> ProjectSlots:
    state = request.app.state
    slots: Any = getattr(state, "project_request_slots", None)
    if slots is None:
        services = state.services
        slots = state.project_request_slots = ProjectSlots(
            int(setting(services, "api_max_requests_per_project")),
            float(setting(services, "api_request_wait_s")))
    return slots  # type: ignore[no-any-return]


async def take_slot(request: Request, project: str) -> None:
    """Take one of ``project``'s slots for ``request`` (released by :class:`ReleaseProjectSlot`); 429 when
    none freed in time (see the module doc)."""
    slots = _slots(request)
    if not slots.enabled or request.scope.get("state", {}).get(_STATE_KEY) is not None:
        return
    if not await slots.acquire(project):
        retry = max(1, math.ceil(float(setting(request.app.state.services, "retry_after_s"))))
        raise HTTPException(429, f"project {project!r} has {slots.limit} query-API requests in flight, the "
                                 f"most one project may ({SETTING}), and none finished within "
                                 f"api_request_wait_s={slots.wait_s:g} s: retry after {retry} s",
                            headers={"Retry-After": str(retry)})
    setattr(request.state, _STATE_KEY, project)


Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


#: an answer's body goes to the server in pieces of at most this many bytes (see :class:`ReleaseProjectSlot`)
ANSWER_PIECE = 64 * 1024


class AnswerStalled(Exception):
    """An answer's piece its client left unread for ``api_answer_write_timeout_s`` (after ``sent`` bytes)."""

    def __init__(self, sent: int) -> None:
        super().__init__(f"answer not read after {sent} bytes")
        self.sent = sent


class ReleaseProjectSlot:
    """ASGI middleware: gives back the project slot a request took (:func:`take_slot`) once the app has
    answered it, response sent or not.

    A body larger than :data:`ANSWER_PIECE` is handed to the server in pieces: uvicorn waits for the
    connection's write buffer to drain before it takes the next one, so the slot is held until the answer is
    (nearly) written. Handed whole, an answer its client never reads stayed in the write buffer after the
    slot was given back (and after the connection was closed): 60 such connections of one project's read
    token took the server from 155 to 517 MB (stop 41). Now unread answers are bounded by the project's slots;
    only its own requests wait -- and only ``api_answer_write_timeout_s`` a piece: a piece its client does not
    make room for within it ends the answer there (uvicorn closes the connection, the rest is never buffered)
    and the slot is given back (before, 8 never-read answers kept a project's reads at 429 for as long as
    their connections stayed open: stop 41 review)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        async def send_in_pieces(message: MutableMapping[str, Any]) -> None:
            body = message.get("body", b"") if message.get("type") == "http.response.body" else b""
            if len(body) <= ANSWER_PIECE:
                await send(message)
                return
            more = bool(message.get("more_body", False))
            view = memoryview(body)
            timeout = float(setting(scope["app"].state.services, "api_answer_write_timeout_s"))
            for start in range(0, len(body), ANSWER_PIECE):
                last = start + ANSWER_PIECE >= len(body)
                piece = {"type": "http.response.body", "body": bytes(view[start:start + ANSWER_PIECE]),
                         "more_body": more or not last}
                try:
                    await asyncio.wait_for(send(piece), timeout)
                except asyncio.TimeoutError:
                    raise AnswerStalled(start) from None

        try:
            await self.app(scope, receive, send_in_pieces if scope.get("type") == "http" else send)
        except AnswerStalled as stalled:  # the answer ends here: uvicorn closes the unfinished response
            log.info("query-API answer to %s not read for api_answer_write_timeout_s after %d bytes: the "
                     "connection is closed and its project's slot given back", scope.get("path"),
                     stalled.sent)
        finally:
            state = scope.get("state")
            project = state.pop(_STATE_KEY, None) if isinstance(state, dict) else None
            if project is not None:
                scope["app"].state.project_request_slots.release(project)
