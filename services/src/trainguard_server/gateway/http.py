"""HTTP ingest: ``POST /v1/ingest`` as a FastAPI router over a :class:`~.ingest.Gateway`.

Contract (docs/wire-format.md; every error body is JSON ``{"detail": "<message>"}``):

=====================================================================  ===========================
request                                                                answer
=====================================================================  ===========================
``Content-Length`` over ``max_batch_bytes`` (checked before reading)   413
both ``Content-Length`` and ``Transfer-Encoding`` (a smuggling shape)  400 + ``Connection: close``
body over ``max_batch_bytes`` while reading (chunked uploads)          413
body holding bytes stalls ``http_body_pressure_timeout_s`` while the   408 + ``Connection: close``
in-flight total has no room for one more ``max_batch_bytes`` body
the project has ``project_max_http_bodies`` bodies being read already   429 + ``Retry-After`` +
(checked before reading: slow uploads hold only their tenant's turns)   ``Connection: close``
no / malformed / two ``Authorization``, unknown or revoked token      401 + ``WWW-Authenticate``
a read token                                                           403
``Content-Type`` not ``application/json`` / ``application/x-protobuf``  415
two ``Content-Type`` headers (which one counts would be a guess)       400
``Content-Encoding`` not ``gzip`` / ``identity`` (all its lines, one   415
list as RFC 9110 5.3 reads them: ``gzip`` + ``identity`` is refused)
gzip body corrupt or over ``max_gzip_members`` members / too big       400 / 413
not JSON / not a serialized IngestRequest / no ``events`` array        400
more than ``max_batch_events`` events                                  413
queue full / queue failing                                             429 / 503 + ``Retry-After``
otherwise (per-item results)                                           200
=====================================================================  ===========================

A 200 body is ``{"accepted": n, "duplicates": n, "rejected": [{index, event_id, code, message}]}`` for a JSON
request and a serialized ``trainguard.v1.IngestResponse`` for a protobuf one. The body is read raw from the
ASGI stream (never through pydantic); decoding, validation and the queue run in the threadpool so the event
loop keeps serving other connections.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from typing import Any, Callable, Dict, List, Optional

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from ..config import Settings
from ..request_headers import framing_conflict
from .inflight import InflightBytes
from .ingest import (
    Backpressure,
    Batch,
    Gateway,
    GatewayError,
    IngestResult,
    InvalidRequest,
    PermissionDenied,
    RequestTooLarge,
    Unauthenticated,
    Unavailable,
    batch_from_json,
    batch_from_protobuf,
    bearer_token,
    one_authorization,
    retry_after_header,
)
from .sent_at import SENT_AT_HEADER

__all__ = ["INGEST_PATH", "JSON_TYPE", "PROTOBUF_TYPES", "UnsupportedMediaType", "gunzip", "ingest_router"]

log = logging.getLogger(__name__)

INGEST_PATH = "/v1/ingest"
JSON_TYPE = "application/json"
PROTOBUF_TYPES = ("application/x-protobuf", "application/protobuf")
PROTOBUF_RESPONSE_TYPE = "application/x-protobuf"


class UnsupportedMediaType(GatewayError):
    """A Content-Type or Content-Encoding this endpoint does not take (HTTP 415)."""


class TooManyBodies(Backpressure):
    """A project already has ``project_max_http_bodies`` ingest bodies being read (HTTP 429 + ``Retry-After``
    + ``Connection: close``, before the body is read: security.md H43)."""


class BodyStalled(GatewayError):
    """A body that stopped arriving while the ingest bytes in flight are full (HTTP 408, and the connection
    is closed: the rest of the body is never read)."""


_STATUS: Dict[type, int] = {
    Unauthenticated: 401, PermissionDenied: 403, InvalidRequest: 400, RequestTooLarge: 413,
    UnsupportedMediaType: 415, Backpressure: 429, Unavailable: 503, BodyStalled: 408,
}


def error_response(exc: GatewayError) -> JSONResponse:
    """The HTTP answer for a whole-request failure."""
    status = next((code for cls, code in _STATUS.items() if isinstance(exc, cls)), 500)
    headers: Dict[str, str] = {}
    if isinstance(exc, Unauthenticated):
        headers["WWW-Authenticate"] = "Bearer"
    if isinstance(exc, (Backpressure, Unavailable)):
        headers["Retry-After"] = retry_after_header(exc.retry_after)
    if isinstance(exc, (AmbiguousFraming, BodyStalled, TooManyBodies)):
        headers["Connection"] = "close"
    return JSONResponse({"detail": str(exc)}, status_code=status, headers=headers)


#: bytes of compressed input handed to zlib at a time: what zlib copies back as a finished member's
#: ``unused_data`` is at most this, so the work stays linear in the body whatever its member count
GUNZIP_CHUNK = 64 * 1024
_DEFAULT_MAX_MEMBERS: int = Settings.model_fields["max_gzip_members"].default


def gunzip(body: bytes, limit: int, *, max_members: int = _DEFAULT_MAX_MEMBERS,
           grow: Optional[Callable[[int], None]] = None, keep: bool = True) -> bytes:
    """Inflate a gzip body of at most ``max_members`` members without ever holding more than ``limit`` + 1
    bytes; the CPU spent is linear in ``len(body)`` + ``limit``.

    Output comes a piece of at most ``GUNZIP_CHUNK`` bytes at a time; ``grow(n)`` is called with each piece's
    size after the size check and before the piece is kept, so a caller counting memory (the bound on ingest
    bytes in flight) can refuse the body the moment it passes its bound (by raising), with at most one piece
    inflated beyond it -- not once the whole body is inflated (stop 41: 64 concurrent 8 KB gzip bodies each
    inflating to 8 MiB took the server from 80 MB to 752 MB before any of their inflated bytes was counted).

    ``keep=False`` checks the body without keeping what it inflates (returns ``b""``): what
    :func:`_decode` does before answering 429, so that a body too large for any server or not gzip at all
    gets its 413 / 400 rather than a 429 its client would retry unchanged.

    :class:`RequestTooLarge` when it inflates past ``limit`` (a gzip bomb stops there);
    :class:`InvalidRequest` when it is not gzip, is truncated, or has more than ``max_members`` members
    (concatenated members, e.g. thousands of empty ones, are refused before the extra one is inflated).
    """
    out = bytearray()
    size = 0
    view = memoryview(body)
    pos, members = 0, 0
    while pos < len(view) or not members:
        members += 1
        if members > max_members:
            raise InvalidRequest(f"gzip body has more than max_gzip_members={max_members} members; send one "
                                 f"gzip stream")
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        member_start = pos
        while not inflater.eof:
            if pos >= len(view):
                raise InvalidRequest("malformed gzip body: truncated")
            data: Any = view[pos:pos + GUNZIP_CHUNK]
            pos += len(data)
            while True:  # one input chunk may inflate to many output pieces
                cap = min(GUNZIP_CHUNK, limit + 1 - size)  # >= 1 here
                try:
                    piece = inflater.decompress(data, cap)
                except zlib.error as exc:
                    if members > 1:  # e.g. bytes appended after a complete gzip stream
                        raise InvalidRequest(f"malformed gzip body: the data after gzip member {members - 1} "
                                             f"(from byte {member_start}) is not gzip ({exc})") from None
                    raise InvalidRequest(f"malformed gzip body: {exc}") from None
                if size + len(piece) > limit:
                    raise RequestTooLarge(f"gzip body inflates to more than max_batch_bytes={limit} bytes; "
                                          f"split the batch")
                if grow is not None and piece:
                    grow(len(piece))
                size += len(piece)
                if keep:
                    out += piece
                data = inflater.unconsumed_tail
                # done with this chunk once its input is used and zlib had no more output to give (a full
                # piece may leave output pending inside zlib: ask again with no input)
                if inflater.eof or (not data and len(piece) < cap):
                    break
        pos -= len(inflater.unused_data)  # the next member starts there
    return bytes(out)


def _media_type(value: Optional[str]) -> str:
    return (value or "").split(";", 1)[0].strip().lower()


class AmbiguousFraming(InvalidRequest):
    """A request framed two ways (HTTP 400, and the connection is closed)."""


def _declared_length(value: Optional[str], limit: int, transfer_encoding: Optional[str] = None) -> None:
    conflict = framing_conflict(value, transfer_encoding)  # the query API's rule too (request_headers.py)
    if conflict is not None:
        raise AmbiguousFraming(conflict)
    if value is None:
        return
    try:
        length = int(value)
    except ValueError:
        raise InvalidRequest(f"invalid Content-Length {value!r}") from None
    if length > limit:
        raise RequestTooLarge(f"body of {length} bytes is larger than max_batch_bytes={limit}; "
                              f"split the batch")


class _Held:
    """The bytes one request holds in the process's :class:`~.inflight.InflightBytes` (None: unbounded)."""

    def __init__(self, inflight: Optional[InflightBytes], project: str, retry_after: float) -> None:
        self.inflight, self.project, self.retry_after = inflight, project, retry_after
        self.n = 0

    def take(self, n: int) -> None:
        """Hold ``n`` more bytes; :class:`Backpressure` (429) when a bound would be passed."""
        if self.inflight is None:
            return
        why = self.inflight.take(self.project, n, self.n)
        if why is not None:
            raise Backpressure(f"{why}: nothing of this request was queued; retry after "
                               f"{retry_after_header(self.retry_after)} s", self.retry_after)
        self.n += n

    def fits(self, declared: Optional[str]) -> None:
        """:class:`Backpressure` when a declared ``Content-Length`` would not fit now (nothing is taken)."""
        if self.inflight is None or declared is None or not declared.isdigit():
            return
        why = self.inflight.fits(self.project, int(declared), self.n)
        if why is not None:
            raise Backpressure(f"{why}: nothing of this request was queued; retry after "
                               f"{retry_after_header(self.retry_after)} s", self.retry_after)

    def release(self) -> None:
        if self.inflight is not None:
            self.inflight.give_back(self.project, self.n)
        self.n = 0

    def pressure(self) -> Optional[str]:
        """Why this request's stalled body should end now (None: it may wait): it holds bytes while the
        process's in-flight total has no room left for one more ``max_batch_bytes`` body."""
        counts = self.inflight
        if counts is None or not self.n or not counts.total:
            return None
        held = counts.held()
        if held + counts.max_request <= counts.total:
            return None
        return (f"this server holds {held} bytes of ingest requests being read or decoded, no room for "
                f"another body of max_batch_bytes={counts.max_request} under {counts.total} "
                f"(TRAINGUARD_INGEST_MAX_INFLIGHT_BYTES)")


def gzip_stated_size(body: bytes) -> int:
    """The size a gzip body's trailer states (ISIZE: its last member's inflated size mod 2**32; 0 when the
    body is shorter than a gzip member can be). A gzip body inflates to at least this many bytes: ISIZE is
    the size mod 2**32, and the last member is part of the whole."""
    return int.from_bytes(body[-4:], "little") if len(body) >= 18 else 0  # 18: header 10 + trailer 8


class _InflatedBytes:
    """Takes a gzip body's inflated bytes in its request's :class:`_Held`: the body counts at its inflated
    size (its compressed bytes, already held, stand for the first of them).

    The size its gzip trailer states (:func:`gzip_stated_size`, what any gzip writer puts there) is taken at
    once, before inflating, capped at ``limit``: concurrent bodies are admitted or refused
    whole, as a ``Content-Length`` is, instead of each taking a part and all of them refused for the parts
    the others took (stop 41: 64 concurrent 8 MiB gzip bodies of one project, taken piece by piece, were all
    answered 429). Whatever inflates beyond that (a trailer that understates, several members) is taken as
    it inflates (:meth:`grow`), so no body is inflated more than one piece past a bound uncounted."""

    def __init__(self, held: _Held, body: bytes, limit: int) -> None:
        self.held, self.counted = held, len(body)
        self.inflated = 0
        more = min(gzip_stated_size(body), limit) - self.counted
        if more > 0:
            held.take(more)  # Backpressure (429) before anything is inflated
            self.counted += more

    def grow(self, n: int) -> None:
        self.inflated += n
        more = self.inflated - self.counted
        if more > 0:
            self.held.take(more)  # Backpressure (429) past a bound: inflating stops here
            self.counted += more


class _StallWatch:
    """Ends a body that stalls while the server is short of bytes (:meth:`_Held.pressure`): a timer looks
    ``stall_s`` after the body's last chunk (:meth:`arrived` notes when); when no chunk came since and the
    pressure is on, it cancels the reading task, which :func:`_read_body` answers with :class:`BodyStalled`
    (408); else it looks again ``stall_s`` after the last chunk. One timer per request, not a task per chunk
    (a chunk costs a clock read); the cancellation can only land where the task waits for the body's next
    chunk (the timer runs only while the task is suspended, and the body's reads are its only waits until
    :meth:`stop`)."""

    def __init__(self, held: _Held, stall_s: float) -> None:
        self.held, self.stall_s = held, stall_s
        self.why: Optional[str] = None
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        self.last = self._loop.time()
        self._timer: Optional[asyncio.TimerHandle] = self._loop.call_later(stall_s, self._look)

    def arrived(self) -> None:
        self.last = self._loop.time()

    def _look(self) -> None:
        self._timer = None
        quiet = self._loop.time() - self.last
        if quiet >= self.stall_s and self._task is not None:
            why = self.held.pressure()
            if why is not None:
                self.why = why
                self.held.release()  # now: another watch looking in this same instant sees them given back
                self._task.cancel()
                return
        self._timer = self._loop.call_later(max(self.stall_s - quiet, 0.0) or self.stall_s, self._look)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def stalled(self) -> BodyStalled:
        """The 408 for the cancellation this watch caused (the task's cancel request is withdrawn)."""
        uncancel = getattr(self._task, "uncancel", None)  # Python >= 3.11 counts cancel requests
        if uncancel is not None:
            uncancel()
        return BodyStalled(f"request body stalled: no byte for http_body_pressure_timeout_s={self.stall_s:g} "
                           f"s while {self.why}; nothing of this request was queued: send the body without "
                           f"pauses")


async def _read_body(request: Request, limit: int, held: Optional[_Held] = None,
                     stall_s: Optional[float] = None) -> bytes:
    """The raw body, refusing to buffer more than ``limit`` bytes (chunked uploads included); each chunk is
    taken in ``held`` as it arrives, after the size check: a body too large for any server is a 413 (split
    it), never a 429 (retry it) because the server happens to be busy. With ``stall_s``, a body that sends
    nothing for that long while the in-flight total is full is answered 408 (:class:`_StallWatch`)."""
    body = bytearray()
    watch = _StallWatch(held, stall_s) if held is not None and held.inflight is not None and stall_s else None
    try:
        async for chunk in request.stream():
            if watch is not None:
                watch.arrived()
            if len(body) + len(chunk) > limit:
                raise RequestTooLarge(f"body is larger than max_batch_bytes={limit}; split the batch")
            if held is not None:
                held.take(len(chunk))
            body += chunk
    except asyncio.CancelledError:
        if watch is not None and watch.why is not None:
            raise watch.stalled() from None
        raise
    finally:
        if watch is not None:
            watch.stop()
    return bytes(body)


def _decode(gateway: Gateway, body: bytes, media_type: str, gzipped: bool,
            held: Optional[_Held] = None) -> Batch:
    limit = gateway.settings.max_batch_bytes
    if gzipped:
        members = gateway.settings.max_gzip_members
        try:
            grow = None if held is None else _InflatedBytes(held, body, limit).grow
            body = gunzip(body, limit, max_members=members, grow=grow)
        except Backpressure:
            gunzip(body, limit, max_members=members, keep=False)  # 413 / 400 first when the body is so
            raise
    if media_type == JSON_TYPE:
        return batch_from_json(body, max_events=gateway.settings.max_batch_events)
    return batch_from_protobuf(body)


def _ingest(gateway: Gateway, auth: Any, body: bytes, media_type: str, gzipped: bool,
            clock_offset_ns: int, held: Optional[_Held] = None) -> IngestResult:
    batch = _decode(gateway, body, media_type, gzipped, held)
    batch.clock_offset_ns = clock_offset_ns
    return gateway.ingest_batch(auth, batch)


def _one_content_type(values: List[str]) -> Optional[str]:
    """The request's one ``Content-Type`` (None without one); :class:`InvalidRequest` for several: which
    one counts would be a guess (this server took the first; a proxy may check the last)."""
    if len(values) > 1:
        shown = ", ".join(repr(v) for v in values[:4]) + (", ..." if len(values) > 4 else "")
        raise InvalidRequest(f"{len(values)} Content-Type headers were sent ({shown}); send exactly one: "
                             f"{JSON_TYPE} or {PROTOBUF_TYPES[0]}")
    return values[0] if values else None


def _content_encoding(values: List[str]) -> Optional[str]:
    """The request's ``Content-Encoding`` lines as the one list RFC 9110 5.3 makes of them (``gzip`` and
    ``identity`` on two lines are ``gzip, identity``, which :func:`_check_media` refuses), not the first."""
    return ", ".join(values) if values else None


def _check_media(content_type: Optional[str], content_encoding: Optional[str]) -> tuple[str, bool]:
    media_type = _media_type(content_type)
    if media_type != JSON_TYPE and media_type not in PROTOBUF_TYPES:
        shown = repr(content_type) if content_type else "missing"
        raise UnsupportedMediaType(f"Content-Type {shown} is not supported; use {JSON_TYPE} or "
                                   f"{PROTOBUF_TYPES[0]}")
    encoding = _media_type(content_encoding)
    if encoding not in ("", "identity", "gzip", "x-gzip"):
        raise UnsupportedMediaType(f"Content-Encoding {content_encoding!r} is not supported; use gzip or "
                                   f"none")
    return media_type, encoding in ("gzip", "x-gzip")


def ingest_router(gateway: Gateway, *, path: str = INGEST_PATH) -> APIRouter:
    """A router with ``POST {path}`` serving ingest through ``gateway`` (see the module docstring)."""
    router = APIRouter(tags=["ingest"])
    settings = gateway.settings
    limit = settings.max_batch_bytes
    inflight = gateway.body_bytes
    bodies = gateway.http_bodies
    retry_after = settings.retry_after_s
    stall_s = settings.http_body_pressure_timeout_s
    request_body = {
        "required": True,
        "description": "A trainguard.v1.IngestRequest: JSON {\"events\": [...]} in the proto3 JSON mapping "
                       "(docs/wire-format.md) or serialized protobuf; optionally gzip-encoded.",
        "content": {JSON_TYPE: {"schema": {"type": "object", "required": ["events"],
                                           "additionalProperties": False,  # else 400 (batch_from_json)
                                           "properties": {"events": {"type": "array",
                                                                     "items": {"type": "object"}}}}},
                    PROTOBUF_TYPES[0]: {"schema": {"type": "string", "format": "binary"}}},
    }
    detail_schema = {"type": "object", "properties": {"detail": {"type": "string"}}}
    error = {"content": {JSON_TYPE: {"schema": detail_schema}}}
    responses: Dict[int | str, Dict[str, Any]] = {
        200: {"description": "acknowledged (durably queued); per-item results"},
        400: {"description": "the body is unusable", **error},
        401: {"description": "missing, unknown or revoked token", **error},
        403: {"description": "not an ingest token", **error},
        408: {"description": "the body stalled while the server is short of memory for bodies: resend it",
              **error},
        413: {"description": "too many bytes or events: split the batch", **error},
        415: {"description": "unsupported Content-Type / Content-Encoding", **error},
        429: {"description": "queue full, or the project's bytes or bodies in flight at their bound: retry "
                             "after Retry-After seconds", **error},
        503: {"description": "queue failing: retry after Retry-After seconds", **error},
    }

    @router.post(path, summary="Ingest a batch of envelopes", responses=responses,
                 openapi_extra={"requestBody": request_body}, response_model=None)
    async def ingest(request: Request) -> Response:
        headers = request.headers
        held: Optional[_Held] = None
        try:
            _declared_length(headers.get("content-length"), limit, headers.get("transfer-encoding"))
            token = bearer_token(one_authorization(headers.getlist("authorization")))
            auth = await run_in_threadpool(gateway.authenticate, token)
            media_type, gzipped = _check_media(_one_content_type(headers.getlist("content-type")),
                                               _content_encoding(headers.getlist("content-encoding")))
            offset = gateway.clock_offset(headers.getlist(SENT_AT_HEADER))  # at receipt, before the body
            held = _Held(inflight, auth.project, retry_after)
            held.fits(headers.get("content-length"))
            why = bodies.enter(auth.project)
            if why is not None:
                raise TooManyBodies(f"{why}: nothing of this request was queued; retry after "
                                    f"{retry_after_header(retry_after)} s", retry_after)
            try:
                body = await _read_body(request, limit, held, stall_s)
            finally:
                bodies.leave(auth.project)
            result = await run_in_threadpool(_ingest, gateway, auth, body, media_type, gzipped, offset, held)
        except GatewayError as exc:
            return error_response(exc)
        except ClientDisconnect:  # gone mid-body (or closed by the body timeout): nobody to answer
            return Response(status_code=400)
        except Exception as exc:  # a bug or a store failure: 500 (retryable for clients), logged
            log.exception("ingest failed")
            return JSONResponse({"detail": f"internal error: {type(exc).__name__}: {exc}"}, status_code=500)
        finally:
            if held is not None:
                held.release()
        if media_type == JSON_TYPE:
            return Response(result.to_json(), media_type=JSON_TYPE)
        return Response(result.to_proto().SerializeToString(), media_type=PROTOBUF_RESPONSE_TYPE)

    return router
