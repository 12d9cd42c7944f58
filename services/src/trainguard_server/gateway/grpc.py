"""gRPC ingest: ``trainguard.v1.IngestService`` (``Send``, client-streaming ``Stream``) over a Gateway.

Contract (docs/wire-format.md):

* auth from the ``authorization: Bearer <token>`` metadata: none / unknown / revoked → ``UNAUTHENTICATED``;
  a read token → ``PERMISSION_DENIED``;
* a message that is not a serialized ``IngestRequest`` → ``INVALID_ARGUMENT`` with the reason (the server
  built by :func:`build_grpc_server` hands the servicer raw bytes, so it can say why, salvage the good
  envelopes of a request whose framing is intact, and queue the received bytes as they are);
* more than ``max_batch_events`` events, or a message over ``max_batch_bytes`` (gRPC's own
  ``max_receive_message_length``: "SERVER: Received message larger than max (N vs. M)", or for a gzip
  message that inflates past it, "Decompressed message larger than max") → ``RESOURCE_EXHAUSTED`` whose
  message says "larger than max", which the SDK answers by splitting the batch;
* queue full → ``RESOURCE_EXHAUSTED`` with trailing metadata ``retry-after: <seconds>``; queue failing →
  ``UNAVAILABLE`` with ``retry-after``; the same ``RESOURCE_EXHAUSTED`` when the message would take its
  project (or the process) past the bound on ingest bytes in flight it shares with HTTP (:mod:`.inflight`:
  a message counts from when its call is served until its worker is done with it, even when the call is
  cancelled meanwhile);
* every answer, success or error, carries trailing metadata ``date``: the server's clock as an HTTP date
  (what the HTTP gateway's ``Date`` header says), from which the SDK corrects a host clock that is wrong;
* call metadata ``x-trainguard-sent-at`` (the sender's clock when it sent the call) shifts the call's event
  times when far off this server's clock (:mod:`.sent_at`; a ``Stream`` by the value it began with); a
  malformed one → ``INVALID_ARGUMENT``;
* otherwise ``IngestResponse`` with per-item results. ``Stream`` authenticates once, ingests each message
  as it arrives (each durably queued before the next is read), de-duplicates across the stream (at least
  its last ``STREAM_SEEN_LIMIT`` ids), indexes rejections by position across the stream, and answers one
  summary at half-close. A stream whose rejections pass ``max_batch_events`` ends with ``INVALID_ARGUMENT``
  (saying what it had queued): their list grew without bound in memory and, past ~8 MiB, the summary could
  not be sent at all ("Sent message larger than max"), so the client learned nothing of what was queued.
  A failure mid-stream ends the call with its status; messages before it stay queued (a retried stream is
  safe: idempotent by event_id).

Fairness (the server of :func:`build_grpc_server`, settings in ``config.py``): it runs on ``grpc.aio``, so a
call waiting for its client's next message holds no thread -- only validation and the queue publish run on
the ``grpc_workers`` threads, a message at a time -- and idle streams cannot starve other clients. Bounds:

* ``grpc_max_streams_per_connection``: HTTP/2 concurrent calls per connection (the client queues more);
* ``grpc_max_streams_per_token``: open ``Stream`` calls per ingest token; one more → ``RESOURCE_EXHAUSTED``
  "too many open streams" with ``retry-after``;
* ``grpc_stream_idle_timeout_s``: a ``Stream`` that receives no message for this long ends with
  ``DEADLINE_EXCEEDED`` "stream idle ..." (what it sent before stays queued); a ``Send`` whose message does
  not arrive within it ends so too;
* a ``Send`` is served as client-streaming (the wire is a unary call's): its token is checked and
  ``max_batch_bytes`` reserved in the bounds on ingest bytes in flight before its message is read, waiting
  (message unread) up to ``grpc_receive_wait_s`` for room; HTTP/2 bandwidth-delay probing is off, so a call
  whose message is not being read holds at most its 64 KiB window (docs/security.md H34).
"""

from __future__ import annotations

import asyncio
import collections
import email.utils
import functools
import logging
import resource
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import (
    Any,
    AsyncIterator,
    Awaitable,
    Callable,
    Deque,
    Dict,
    Iterator,
    List,
    NoReturn,
    Optional,
    OrderedDict,
    Set,
    Tuple,
    TypeVar,
    Union,
)

import grpc

from trainguard.v1 import ingest_pb2, ingest_pb2_grpc

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
    batch_from_protobuf,
    bearer_token,
    one_authorization,
    retry_after_header,
)
from .sent_at import SENT_AT_HEADER

__all__ = ["SERVICE", "STREAM_SEEN_LIMIT", "AsyncIngestServicer", "GrpcIngestServer", "IngestServicer",
           "StreamLimits", "build_grpc_server"]

log = logging.getLogger(__name__)

SERVICE = "trainguard.v1.IngestService"
#: a Stream remembers at least this many recent event ids for its duplicate count (then starts afresh)
STREAM_SEEN_LIMIT = 100_000

_CODES: Dict[type, grpc.StatusCode] = {
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED, PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT, RequestTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Backpressure: grpc.StatusCode.RESOURCE_EXHAUSTED, Unavailable: grpc.StatusCode.UNAVAILABLE,
}

RequestLike = Union[bytes, ingest_pb2.IngestRequest]
T = TypeVar("T")


def _metadata(context: Any, key: str) -> List[str]:
    """The call's invocation metadata values under ``key``, as text."""
    return [value if isinstance(value, str) else value.decode("latin-1")
            for name, value in context.invocation_metadata() or () if name == key]


def _token(context: Any) -> Optional[str]:
    return bearer_token(one_authorization(_metadata(context, "authorization")))


def _batch(request: RequestLike, clock_offset_ns: int) -> Batch:
    if isinstance(request, (bytes, bytearray, memoryview)):
        batch = batch_from_protobuf(bytes(request))
    else:
        batch = Batch(request)  # registered with the generated deserializer: already parsed
    batch.clock_offset_ns = clock_offset_ns
    return batch


def _clock_offset(gateway: Gateway, context: Any) -> int:
    """The call's event-time shift from its ``x-trainguard-sent-at`` metadata, read when the call began."""
    return gateway.clock_offset(_metadata(context, SENT_AT_HEADER))


def _date() -> Tuple[Tuple[str, str], ...]:
    """The ``date`` trailing metadata every answer carries: this server's clock, an HTTP date."""
    return (("date", email.utils.formatdate(usegmt=True)),)


def _status(exc: GatewayError) -> Tuple[grpc.StatusCode, Tuple[Tuple[str, str], ...]]:
    """The status code and trailing metadata that stand for ``exc``."""
    code = next((c for cls, c in _CODES.items() if isinstance(exc, cls)), grpc.StatusCode.INTERNAL)
    if isinstance(exc, (Backpressure, Unavailable)):
        return code, (("retry-after", retry_after_header(exc.retry_after)),)
    return code, ()


def _abort(context: Any, exc: GatewayError) -> None:
    """End the call with the status for ``exc`` (raises, as ``context.abort`` does)."""
    code, trailing = _status(exc)
    context.set_trailing_metadata(trailing + _date())
    context.abort(code, str(exc))


def _stream_error(exc: GatewayError, offset: int, accepted: int) -> GatewayError:
    """``exc`` with a note on what the stream had queued before it (auth errors come before anything)."""
    if offset and not isinstance(exc, (Unauthenticated, PermissionDenied)):
        return type(exc)(*_with_note(exc, offset, accepted))
    return exc


class _StreamState:
    """What one ``Stream`` call has done so far: its running result, the ids it saw, events read."""

    def __init__(self, clock_offset_ns: int = 0) -> None:
        self.total = IngestResult()
        self.seen: Set[str] = set()
        self.offset = 0
        self.clock_offset_ns = clock_offset_ns  # from the call's metadata, once: the stream's send time

    def ingest(self, gateway: Gateway, auth: Any, request: RequestLike) -> None:
        """Parse, validate and queue one message of the stream (blocking)."""
        batch = _batch(request, self.clock_offset_ns)
        self.total.merge(gateway.ingest_batch(auth, batch, index_offset=self.offset, seen=self.seen))
        self.offset += batch.count
        if len(self.seen) > STREAM_SEEN_LIMIT:  # bounded memory on a long stream; stores dedupe anyway
            self.seen.clear()
        limit = gateway.settings.max_batch_events
        if len(self.total.rejected) > limit:  # the summary must fit one response, and the memory a bound
            first = self.total.rejected[0]
            raise InvalidRequest(f"more than max_batch_events={limit} events of this stream were rejected "
                                 f"(the first: {first.message}); fix what sends them")


class IngestServicer(ingest_pb2_grpc.IngestServiceServicer):
    """``IngestService`` over ``gateway`` for a thread-pool ``grpc.server``. Requests may be raw bytes or
    ``IngestRequest`` messages (registered with the generated ``add_IngestServiceServicer_to_server``).
    A ``Stream`` holds a pool thread until it ends: :func:`build_grpc_server` serves
    :class:`AsyncIngestServicer` instead."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def Send(self, request: RequestLike, context: Any) -> ingest_pb2.IngestResponse:
        try:
            auth = self.gateway.authenticate(_token(context))
            result = self.gateway.ingest_batch(auth, _batch(request, _clock_offset(self.gateway, context)))
        except GatewayError as exc:
            _abort(context, exc)
            raise  # not reached: abort raises
        except Exception as exc:
            log.exception("ingest Send failed")
            context.set_trailing_metadata(_date())
            context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
            raise
        context.set_trailing_metadata(_date())
        return result.to_proto()

    def Stream(self, request_iterator: Iterator[RequestLike], context: Any) -> ingest_pb2.IngestResponse:
        state = _StreamState()
        try:
            auth = self.gateway.authenticate(_token(context))
            state.clock_offset_ns = _clock_offset(self.gateway, context)
            for request in request_iterator:
                state.ingest(self.gateway, auth, request)
        except GatewayError as exc:
            _abort(context, _stream_error(exc, state.offset, state.total.accepted))
            raise
        except Exception as exc:
            log.exception("ingest Stream failed")
            context.set_trailing_metadata(_date())
            context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
            raise
        context.set_trailing_metadata(_date())
        return state.total.to_proto()


def _with_note(exc: GatewayError, offset: int, accepted: int) -> tuple[Any, ...]:
    """``exc``'s constructor arguments with a note on what the stream had already queued."""
    message = (f"{exc} (after {offset} events of this stream; {accepted} of them were queued, "
               f"re-sending them is safe)")
    retry_after = getattr(exc, "retry_after", None)
    return (message,) if retry_after is None else (message, retry_after)


# ------------------------------------------------------------------------------------------- grpc.aio

@dataclass(frozen=True)
class StreamLimits:
    """The fairness bounds of :class:`AsyncIngestServicer` (see the module docstring)."""

    per_connection: int = 100
    per_token: int = 16
    idle_timeout_s: float = 60.0
    retry_after_s: float = 1.0
    #: how long a ``Send`` waits, its message unread, for room to hold ``max_batch_bytes`` under the bounds on
    #: ingest bytes in flight before it is answered RESOURCE_EXHAUSTED (``grpc_receive_wait_s``)
    receive_wait_s: float = 5.0
    #: ``grpc_workers`` threads one project's work may take at once (0: all); see :class:`_FairWork`
    per_project_workers: int = 4
    #: calls of one project waiting for room in :meth:`AsyncIngestServicer._reserve` (0: no bound); one more
    #: is refused at once: each waiting call's stream holds its 64 KiB HTTP/2 window (security.md H37)
    max_waiting_per_project: int = 256

    @classmethod
    def from_settings(cls, settings: Any) -> StreamLimits:
        return cls(per_connection=settings.grpc_max_streams_per_connection,
                   per_token=settings.grpc_max_streams_per_token,
                   idle_timeout_s=settings.grpc_stream_idle_timeout_s, retry_after_s=settings.retry_after_s,
                   receive_wait_s=settings.grpc_receive_wait_s,
                   per_project_workers=settings.grpc_workers_per_project,
                   max_waiting_per_project=settings.grpc_max_waiting_per_project)


class _Failed(Exception):
    """A status to end the call with, decided outside the ``except`` that found it."""

    def __init__(self, code: grpc.StatusCode, details: str,
                 trailing: Tuple[Tuple[str, str], ...] = ()) -> None:
        super().__init__(details)
        self.code, self.details, self.trailing = code, details, trailing

    @classmethod
    def of(cls, exc: GatewayError) -> _Failed:
        code, trailing = _status(exc)
        return cls(code, str(exc), trailing)

    @classmethod
    def internal(cls, exc: Exception) -> _Failed:
        return cls(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")

    async def abort(self, context: Any) -> NoReturn:
        context.set_trailing_metadata(self.trailing + _date())
        await context.abort(self.code, self.details)
        raise AssertionError("not reached: abort raises")


class _FairWork:
    """The blocking work of gRPC ingest on ``workers`` threads of ``executor``, the keys (projects) with work
    queued taking turns one job each, and one project running at most ``per_key`` jobs at once
    (``grpc_workers_per_project``; authentication is keyed apart: ``_AUTH`` + the project of a token seen to
    pass, ``_AUTH`` for every other token, each bounded so too), so a
    project with hundreds of messages queued delays another project's message by about one job, and shares the
    one GIL with fewer of its threads. Before stop 43 the pool's one FIFO queue put a quiet project's message
    behind every queued message of a noisy one, and all 8 threads ran the noisy one's: 1,000 concurrent Sends
    of one project took the quiet one's ack p50 from ~3 ms to 0.3-1.4 s (bench/grpc_waiters.py; 15-18 ms with
    4 per project, 9-15 ms with 2, at 11-26 % and 20-40 % less of the noisy project's throughput: fewer of its
    publishes share a queue commit). Jobs are ``concurrent.futures`` futures: cancelling one not yet running
    cancels it, and its done-callbacks run either way."""

    def __init__(self, executor: futures.Executor, workers: int, per_key: int = 0) -> None:
        self.executor = executor
        self.workers = max(1, workers)
        self.per_key = per_key if per_key > 0 else self.workers
        self._queued: Dict[str, Deque[Tuple[futures.Future[Any], Callable[[], Any]]]] = {}
        self._turns: Deque[str] = collections.deque()
        self._running: Dict[str, int] = {}
        self._busy = 0
        self._lock = threading.Lock()

    def submit(self, key: str, fn: Callable[[], T]) -> futures.Future[T]:
        job: futures.Future[T] = futures.Future()
        with self._lock:
            queue = self._queued.get(key)
            if queue is None:
                queue = self._queued[key] = collections.deque()
                self._turns.append(key)
            queue.append((job, fn))
        self._dispatch()
        return job

    def _next(self) -> Optional[Tuple[str, futures.Future[Any], Callable[[], Any]]]:
        """The next job to start (under the lock): the first key in turn below ``per_key``."""
        if self._busy >= self.workers:
            return None
        for _ in range(len(self._turns)):
            key = self._turns.popleft()
            if self._running.get(key, 0) >= self.per_key:
                self._turns.append(key)
                continue
            queue = self._queued[key]
            job, fn = queue.popleft()
            if queue:
                self._turns.append(key)
            else:
                del self._queued[key]
            return key, job, fn
        return None

    def _dispatch(self) -> None:
        while True:
            with self._lock:
                found = self._next()
                if found is None:
                    return
                key, job, fn = found
                if not job.set_running_or_notify_cancel():
                    continue  # cancelled while queued (its done-callbacks ran)
                self._busy += 1
                self._running[key] = self._running.get(key, 0) + 1
            try:
                self.executor.submit(self._run, key, job, fn)
            except BaseException as exc:  # the executor is shut down (a stop)
                self._done(key)
                job.set_exception(exc)

    def _done(self, key: str) -> None:
        with self._lock:
            self._busy -= 1
            left = self._running[key] - 1
            if left:
                self._running[key] = left
            else:
                del self._running[key]

    def _run(self, key: str, job: futures.Future[Any], fn: Callable[[], Any]) -> None:
        try:
            result = fn()
        except BaseException as exc:
            job.set_exception(exc)
        else:
            job.set_result(result)
        finally:
            self._done(key)
            self._dispatch()


#: the key of authentication work in :class:`_FairWork` for a token not seen to pass (the project is not
#: known yet): one turn all such tokens share; a token that passed before is checked in ``_AUTH + project``
_AUTH = "\0auth"
#: token texts remembered with their project for :meth:`AsyncIngestServicer._auth_key` (:class:`_TokenTurns`)
AUTH_KEYS_MAX = 4096


class _TokenTurns:
    """Token texts seen to pass, with their project, at most ``size`` of them, so that a known token's
    authentication is queued in its project's turn (:meth:`AsyncIngestServicer._auth_key`). Full, it forgets
    the least recently used token of the project holding the most (ties: the project used least recently), so
    one project's many distinct tokens push out only its own: a quiet tenant's one token stays as long as any
    project holds more. Before stop 45 the whole table was cleared at ``size`` entries -- one tenant using
    4,096 distinct tokens sent every tenant's next check back to the shared ``_AUTH`` turn (security.md H45).
    Used on the event loop's thread only (no lock)."""

    def __init__(self, size: int = AUTH_KEYS_MAX) -> None:
        self.size = max(1, size)
        self._project: Dict[str, str] = {}
        #: project -> its tokens, least recently used first; projects least recently used first
        self._tokens: OrderedDict[str, OrderedDict[str, None]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._project)

    def get(self, token: str) -> Optional[str]:
        project = self._project.get(token)
        if project is not None:
            self._tokens[project].move_to_end(token)
            self._tokens.move_to_end(project)
        return project

    def put(self, token: str, project: str) -> None:
        known = self._project.get(token)
        if known is not None:
            if known == project:
                self.get(token)
                return
            self._forget(token)
        if len(self._project) >= self.size:
            self._evict()
        self._project[token] = project
        tokens = self._tokens.get(project)
        if tokens is None:
            tokens = self._tokens[project] = collections.OrderedDict()
        tokens[token] = None
        self._tokens.move_to_end(project)

    def _evict(self) -> None:
        most = max(self._tokens, key=lambda project: len(self._tokens[project]))  # the first of the largest
        self._forget(next(iter(self._tokens[most])))

    def _forget(self, token: str) -> None:
        project = self._project.pop(token)
        tokens = self._tokens[project]
        del tokens[token]
        if not tokens:
            del self._tokens[project]


class AsyncIngestServicer:
    """``IngestService`` for a ``grpc.aio`` server (raw bytes in). Blocking gateway work runs on
    ``executor``; waiting for a client's next message holds no thread. Open streams are counted per token
    on the event loop's thread (no lock needed)."""

    def __init__(self, gateway: Gateway, executor: futures.Executor, limits: StreamLimits,
                 workers: int = 8) -> None:
        self.gateway = gateway
        self.executor = executor
        self.work = _FairWork(executor, workers, limits.per_project_workers)
        self.limits = limits
        self.open_streams: Dict[str, int] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        #: Sends waiting for room per project, oldest first (futures on the loop, no task each: a stop with
        #: calls waiting leaves no task pending), and the projects with waiters in turn order (:meth:`_grant`)
        #: (keyed by project and whether the calls are Streams: their share is bounded apart, _stream_room)
        self._waiting: Dict[Tuple[str, bool], Deque[asyncio.Future[int]]] = {}
        self._turns: Deque[Tuple[str, bool]] = collections.deque()
        #: the keys with an entry in ``_turns`` (one each: a key whose last waiter gave up keeps its turn
        #: until the next _grant drops it, and a new waiter of it meanwhile must not add another)
        self._turned: Set[Tuple[str, bool]] = set()
        #: bytes per project reserved by Streams for a next message not yet arrived (:meth:`_stream_room`)
        self._stream_reserved: Dict[str, int] = {}
        self._grant_due = False
        #: token text -> its project, for its authentication's :class:`_FairWork` key (:meth:`_auth_key`)
        self._auth_keys = _TokenTurns(AUTH_KEYS_MAX)

    async def _authenticate(self, context: Any) -> Any:
        """The call's token checked on a worker, in the turn of its project when the same token text passed
        before (:meth:`_auth_key`), so one tenant's many authentications -- a flood of bad tokens above all
        -- do not delay another tenant's."""
        token = _token(context)
        key = self._auth_key(token)
        info = await asyncio.wrap_future(self.work.submit(key, functools.partial(self.gateway.authenticate,
                                                                                token)))
        if key == _AUTH and token:
            self._remember_token(token, info.project)
        return info

    def _auth_key(self, token: Optional[str]) -> str:
        """The :class:`_FairWork` key of an authentication: ``_AUTH`` + the project of a token text that
        authenticated before (remembered on the loop; a revoked one is still refused, this only picks the
        queue), else ``_AUTH`` alone -- the turn every unknown token shares, so that tokens a client makes up
        (or a known token id with a wrong secret) cannot take a tenant's turn. Before stop 44 every
        authentication shared the one ``_AUTH`` FIFO: 1,000 concurrent Sends with a wrong secret took a quiet
        project's ack p50 / p90 from ~3 ms to 59 / 503 ms (bench/grpc_waiters.py --bad-token)."""
        if not token:
            return _AUTH
        project = self._auth_keys.get(token)
        return _AUTH if project is None else _AUTH + project

    def _remember_token(self, token: str, project: str) -> None:
        self._auth_keys.put(token, project)  # bounded; a flood of one project's tokens forgets its own first

    def _give_back(self, project: str, held: int) -> None:
        """Give ``held`` bytes back (the bound's listener then grants waiting Sends their room)."""
        if held and self.gateway.body_bytes is not None:
            self.gateway.body_bytes.give_back(project, held)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve on ``loop``: from now on every give-back of ingest bytes, gRPC's or HTTP's, grants waiting
        Sends their room (:meth:`_granted`)."""
        self._loop = loop
        if self.gateway.body_bytes is not None:
            self.gateway.body_bytes.listeners.append(self._room_freed)

    def detach(self) -> None:
        counts = self.gateway.body_bytes
        if counts is not None and self._room_freed in counts.listeners:
            counts.listeners.remove(self._room_freed)

    def _room_freed(self) -> None:
        """Bytes were given back (any thread): grant waiting Sends on the loop, once per loop turn however
        many give-backs came meanwhile."""
        loop = self._loop
        if not self._waiting or self._grant_due or loop is None:
            return  # no Send waits (one that starts waiting runs a grant after queueing itself)
        self._grant_due = True
        try:
            if asyncio.get_running_loop() is loop:
                loop.call_soon(self._grant)
                return
        except RuntimeError:  # a worker's thread, or HTTP's: no loop in this thread
            pass
        try:
            loop.call_soon_threadsafe(self._grant)
        except RuntimeError:  # the loop closed meanwhile
            self._grant_due = False

    def _grant(self) -> None:
        """Hand room to waiting Sends (on the loop): the projects with waiters in turn, each its oldest
        waiters first for as long as its take succeeds, so a project at its bound does not hold up another
        whose Send fits (before stop 43 one give-back woke the oldest waiter only, and a waiter that could
        not take the room did not pass it on), and a project with a thousand waiting Sends gets no more
        turns than one with one. The waiter's future is given the bytes reserved for it."""
        self._grant_due = False
        counts = self.gateway.body_bytes
        if counts is None:
            return
        n = self.gateway.settings.max_batch_bytes
        for _ in range(len(self._turns)):
            key = self._turns.popleft()
            project, stream = key
            queue = self._waiting.get(key)
            while queue:
                waiter = queue[0]
                if waiter.done():  # timed out or cancelled
                    queue.popleft()
                    continue
                if (stream and not self._stream_room(project, n)) or counts.take(project, n) is not None:
                    break
                queue.popleft()
                if stream:
                    self._stream_reserved[project] = self._stream_reserved.get(project, 0) + n
                waiter.set_result(n)
            if queue:
                self._turns.append(key)
            else:
                self._waiting.pop(key, None)
                self._turned.discard(key)

    def _stream_room(self, project: str, n: int) -> bool:
        """Whether a Stream of ``project`` may reserve ``n`` more bytes for its next message: the project's
        Streams waiting for their clients hold at most its bound less one ``max_batch_bytes`` (3 of its 4
        reservations at the defaults; one Stream always), so its Sends and HTTP bodies always find room. A
        live Stream holds its reservation while its client is idle: without this share, 4 idle Streams of a
        project answered every HTTP ingest request of the project 429 and made its Sends wait for a Stream's
        next message (hR, stop 43)."""
        counts = self.gateway.body_bytes
        held = self._stream_reserved.get(project, 0)
        if counts is None or not counts.per_project or not held:
            return True
        return held + n <= counts.per_project - n

    def _stream_release(self, project: str, n: int) -> None:
        """A Stream's reservation for its next message ended (the message came, or the stream did)."""
        left = self._stream_reserved.get(project, 0) - n
        if left > 0:
            self._stream_reserved[project] = left
        else:
            self._stream_reserved.pop(project, None)
        if n:
            self._room_freed()  # a Stream waiting for the Streams' share may go on

    def _forget(self, key: Tuple[str, bool], waiter: asyncio.Future[int]) -> None:
        """Take a waiter that timed out or was cancelled off its project's queue at once (a granted one is
        already off it): the queue holds only calls still waiting (``max_waiting_per_project`` counts it)."""
        queue = self._waiting.get(key)
        if queue is None or (waiter.done() and not waiter.cancelled() and waiter.result()):
            return
        try:
            queue.remove(waiter)
        except ValueError:
            pass
        if not queue:
            del self._waiting[key]  # its turn is dropped by the next _grant (``_turned`` keeps it single)

    async def _reserve(self, project: str, wait_s: Optional[float] = None, stream: bool = False) -> int:
        """Before a ``Send``'s message is read: hold ``max_batch_bytes`` (the most its message may be) in the
        bound on ingest bytes in flight, waiting for room up to ``receive_wait_s`` (on the event loop, no
        thread; the message stays unread, so gRPC's core holds at most its stream's flow-control window);
        :class:`Backpressure` (RESOURCE_EXHAUSTED + retry-after) when none came. The bytes held (0: no bound).
        ``wait_s``: how long to wait instead (a ``Stream``'s next message: its idle timeout). ``stream``: for
        a Stream's next message (within the Streams' share, :meth:`_stream_room`; the caller ends the
        reservation with :meth:`_stream_release`).

        Before stop 42 the message was received whole by gRPC's core before the servicer was called (a
        unary handler), and only then counted: 4 connections x 100 calls each sending 8 MB less one byte,
        without a token, took ``trainguard serve`` from 78 MB to 3.2 GB, held for as long as they stalled.

        A Send finding no room queues behind its project's earlier waiters and is granted room by the next
        give-back that leaves enough (:meth:`_grant`); before stop 43 every waiter looked again every 50 ms
        (1,000 waiting Sends: 14-35 % of a core) and a give-back woke one waiter, which did not pass it on."""
        counts = self.gateway.body_bytes
        n = self.gateway.settings.max_batch_bytes
        if counts is None or n <= 0:
            return 0
        key = (project, stream)
        if key not in self._waiting and (not stream or self._stream_room(project, n)):  # FIFO: no overtaking
            why = counts.take(project, n)
            if why is None:
                if stream:
                    self._stream_reserved[project] = self._stream_reserved.get(project, 0) + n
                return n
        waiting = sum(len(self._waiting.get((project, kind), ())) for kind in (False, True))
        most = self.limits.max_waiting_per_project
        if most and waiting >= most:
            retry = self.limits.retry_after_s
            full = counts.fits(project, n) or "no room"
            raise Backpressure(f"project {project!r} has {waiting} gRPC calls waiting for room to "
                               f"receive their messages, at most {most} may "
                               f"(TRAINGUARD_GRPC_MAX_WAITING_PER_PROJECT; {full}): nothing of this message "
                               f"was queued; retry after {retry_after_header(retry)} s", retry)
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self.attach(loop)
        waiter: asyncio.Future[int] = loop.create_future()
        if key not in self._waiting:
            self._waiting[key] = collections.deque()
            if key not in self._turned:  # (its turn may outlive a queue _forget dropped)
                self._turned.add(key)
                self._turns.append(key)
        self._waiting[key].append(waiter)

        def give_up() -> None:
            if not waiter.done():
                waiter.set_result(0)

        wait = self.limits.receive_wait_s if wait_s is None else wait_s
        timer = loop.call_later(wait, give_up)
        self._grant()  # room given back before this waiter was queued is granted now
        try:
            granted = await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.result():
                if stream:
                    self._stream_release(project, waiter.result())
                self._give_back(project, waiter.result())  # granted just before the cancel
            raise
        finally:
            timer.cancel()
            self._forget(key, waiter)
        if granted:
            return granted
        why = counts.fits(project, n) or "no room was given back"
        setting = ("TRAINGUARD_GRPC_RECEIVE_WAIT_S" if wait_s is None
                   else "TRAINGUARD_GRPC_STREAM_IDLE_TIMEOUT_S")
        retry = self.limits.retry_after_s
        raise Backpressure(f"{why}: this call waited {wait:g} s ({setting}) for room to receive a message of "
                           f"up to max_batch_bytes={n} bytes; "
                           f"nothing of this message was queued; retry after "
                           f"{retry_after_header(retry)} s", retry)

    async def _one_message(self, request_iterator: AsyncIterator[bytes]) -> bytes:
        """A ``Send``'s message (served as client-streaming so that the call is authenticated and its bytes
        reserved before the message is read): the first message, within ``idle_timeout_s``."""
        idle = self.limits.idle_timeout_s
        try:
            message = await asyncio.wait_for(request_iterator.__aiter__().__anext__(), idle)
        except StopAsyncIteration:
            raise _Failed(grpc.StatusCode.INVALID_ARGUMENT,
                          "Send carried no message: send one IngestRequest") from None
        except asyncio.TimeoutError:
            raise _Failed(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"the Send's message did not arrive within grpc_stream_idle_timeout_s={idle:g} s; "
                          f"nothing of it was queued") from None
        return bytes(message)

    async def _holding(self, project: str, held: int, fn: Callable[[], T]) -> T:
        """Run ``fn`` on a worker; the ``held`` bytes are given back when the worker is done with them, not
        when this coroutine ends: a call cancelled (by its client, or past its deadline) while its message
        is decoded keeps its bytes until the decode ends (before stop 41 they were given back at the
        cancellation while the worker went on). One that never started is given back at once."""
        try:
            work = self.work.submit(project, fn)
        except BaseException:
            self._give_back(project, held)
            raise
        work.add_done_callback(lambda _: self._give_back(project, held))  # thread-safe (a lock)
        return await asyncio.wrap_future(work)  # cancelling this cancels ``work`` only if not yet running

    async def Send(self, request_iterator: AsyncIterator[bytes], context: Any) -> ingest_pb2.IngestResponse:
        """Served as client-streaming (the wire is the same as a unary call's): the token is checked and
        the message's bytes reserved (:meth:`_reserve`) before the message is read, so a call without a
        valid token, or past its project's bound, never gets its message buffered whole."""
        reserved = 0
        project = ""
        try:
            auth = await self._authenticate(context)
            offset = _clock_offset(self.gateway, context)
            project = auth.project
            reserved = await self._reserve(project)
            request = await self._one_message(request_iterator)
            held = min(reserved, len(request)) if reserved else 0
            self._give_back(project, reserved - held)  # keep what the message holds
            reserved = 0
            result = await self._holding(project, held,
                                         lambda: self.gateway.ingest_batch(auth, _batch(request, offset)))
            context.set_trailing_metadata(_date())
            return result.to_proto()
        except _Failed as exc:
            failed = exc
        except GatewayError as exc:
            failed = _Failed.of(exc)
        except Exception as exc:
            log.exception("ingest Send failed")
            failed = _Failed.internal(exc)
        finally:
            if reserved:  # the message never came (or the call was cancelled): give the reservation back
                self._give_back(project, reserved)
        await failed.abort(context)

    async def Stream(self, request_iterator: AsyncIterator[bytes], context: Any) -> ingest_pb2.IngestResponse:
        try:
            auth = await self._authenticate(context)
            offset = _clock_offset(self.gateway, context)
        except GatewayError as exc:
            await _Failed.of(exc).abort(context)
        key = auth.token_id
        if self.open_streams.get(key, 0) >= self.limits.per_token:
            await _Failed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"too many open streams for this token ({self.limits.per_token}, "
                          f"grpc_max_streams_per_token): end one, or use Send",
                          (("retry-after", retry_after_header(self.limits.retry_after_s)),)).abort(context)
        self.open_streams[key] = self.open_streams.get(key, 0) + 1
        try:
            return await self._stream(auth, request_iterator, context, offset)
        finally:
            left = self.open_streams[key] - 1
            if left:
                self.open_streams[key] = left
            else:
                del self.open_streams[key]

    async def _stream(self, auth: Any, request_iterator: AsyncIterator[bytes], context: Any,
                      clock_offset_ns: int) -> ingest_pb2.IngestResponse:
        """Each next message is read only once ``max_batch_bytes`` is reserved for it, as a ``Send``'s is
        (waiting for room up to the idle timeout: the client sees a slow stream). Before stop 43 the next
        message was read unreserved: gRPC's core received up to ``max_batch_bytes`` for every open stream
        before the servicer counted it -- 16 streams x 8 MiB per ingest token held for the 60 s idle timeout,
        outside every bound (security.md H36)."""
        state = _StreamState(clock_offset_ns)
        messages = request_iterator.__aiter__()
        idle = self.limits.idle_timeout_s
        project = auth.project
        reserved = 0
        try:
            while True:
                reserved = await self._reserve(project, idle, stream=True)
                try:
                    request = await asyncio.wait_for(messages.__anext__(), idle)
                except StopAsyncIteration:
                    context.set_trailing_metadata(_date())
                    return state.total.to_proto()
                except asyncio.TimeoutError:
                    raise _Failed(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"stream idle for more than grpc_stream_idle_timeout_s={idle:g} s "
                                  f"(after {state.offset} events of this stream; {state.total.accepted} "
                                  f"of them were queued, re-sending them is safe)") from None
                held = min(reserved, len(request)) if reserved else 0
                self._stream_release(project, reserved)
                self._give_back(project, reserved - held)  # keep what the message holds
                reserved = 0
                await self._holding(project, held,
                                    functools.partial(state.ingest, self.gateway, auth, request))
        except _Failed as exc:
            failed = exc
        except GatewayError as exc:
            failed = _Failed.of(_stream_error(exc, state.offset, state.total.accepted))
        except Exception as exc:
            log.exception("ingest Stream failed")
            failed = _Failed.internal(exc)
        finally:
            if reserved:  # the message never came (half-close, idle, cancelled): give the reservation back
                self._stream_release(project, reserved)
                self._give_back(project, reserved)
        await failed.abort(context)


class GrpcIngestServer:
    """``IngestService`` on a ``grpc.aio`` server whose event loop runs on its own daemon thread, with the
    surface of a ``grpc.Server`` that its callers use: :meth:`start`, and :meth:`stop` returning an event
    set once the server and its loop are down. The port is bound in the constructor (``port``)."""

    def __init__(self, gateway: Gateway, host: str, port: int, options: Any, limits: StreamLimits,
                 workers: int) -> None:
        self.executor = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc-ingest")
        self.servicer = AsyncIngestServicer(gateway, self.executor, limits, workers)
        self._stopped = threading.Event()
        self._loop = asyncio.new_event_loop()
        self.servicer.attach(self._loop)
        self._thread = threading.Thread(target=self._run, name="grpc-ingest-loop", daemon=True)
        self._thread.start()
        self._server: Any = None
        try:
            self.port: int = self._call(self._bind(host, port, options))
        except BaseException:
            self.stop(None).wait(5)
            raise

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self.servicer.detach()
            self.executor.shutdown(wait=False)
            self._loop.close()
            self._stopped.set()

    def _call(self, coro: Awaitable[T], timeout: Optional[float] = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(_awaited(coro), self._loop).result(timeout)

    async def _bind(self, host: str, port: int, options: Any) -> int:
        self._server = grpc.aio.server(options=options)
        serialize = ingest_pb2.IngestResponse.SerializeToString
        handlers = {
            # client-streaming on this side (a unary call's wire is the same): see AsyncIngestServicer.Send
            "Send": grpc.stream_unary_rpc_method_handler(self.servicer.Send, request_deserializer=None,
                                                         response_serializer=serialize),
            "Stream": grpc.stream_unary_rpc_method_handler(self.servicer.Stream, request_deserializer=None,
                                                           response_serializer=serialize),
        }
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        try:
            bound = self._server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:  # grpcio raises instead of returning 0 on some versions
            bound = 0
        if not bound:
            raise OSError(f"cannot bind gRPC ingest to {host}:{port}")
        return int(bound)

    def start(self) -> None:
        self._call(self._server.start())

    def stop(self, grace: Optional[float]) -> threading.Event:
        """Stop accepting; calls still running get ``grace`` seconds (None: cancelled now). Returns an
        event set once everything is down. Idempotent."""
        if not self._stopped.is_set():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(grace), self._loop)
            except RuntimeError:  # the loop closed meanwhile: already down
                pass
        return self._stopped

    async def _shutdown(self, grace: Optional[float]) -> None:
        try:
            if self._server is not None:
                await self._server.stop(grace)
        finally:
            # the calls the stop cancelled (a Send waiting for room or its message, an idle Stream) end before
            # the loop does: stopping it under them logged "Task was destroyed but it is pending!" per call
            current = asyncio.current_task()
            pending = [task for task in asyncio.all_tasks() if task is not current and not task.done()]
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=2.0)
            asyncio.get_running_loop().stop()


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


def max_connections(settings: Any) -> int:
    """The gRPC connections the server accepts at once (H38): ``grpc_max_connections``, or when 0 half this
    process's open-files limit, so that idle gRPC connections cannot take the descriptors HTTP, the stores and
    the queue need (900 such connections against a limit of 800 left HTTP ingest timing out for as long as
    they were held). Past it gRPC's core closes a new connection at once."""
    if settings.grpc_max_connections > 0:
        return int(settings.grpc_max_connections)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(64, (soft if soft != resource.RLIM_INFINITY else 65_536) // 2)


def build_grpc_server(gateway: Gateway, host: str, port: int, max_message_bytes: int,
                      workers: Optional[int] = None) -> Tuple[GrpcIngestServer, int]:
    """``(server, bound port)``: a not yet started server of ``IngestService`` on ``host:port`` (port 0: any
    free port). Call ``.start()`` on it, and ``.stop(grace).wait(timeout)`` to end.

    The servicer receives each message as raw bytes (no deserializer): it parses them itself, which gives
    precise INVALID_ARGUMENT messages and lets the gateway queue the bytes as received. Messages over
    ``max_message_bytes`` (after gzip decompression) are refused by gRPC with RESOURCE_EXHAUSTED
    "Received message larger than max (N vs. M)" before they reach Python. ``workers`` (default: the
    ``grpc_workers`` setting) threads run the blocking work; the stream bounds come from the gateway's
    settings (:class:`StreamLimits`).
    """
    settings = gateway.settings
    limits = StreamLimits.from_settings(settings)
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max(max_message_bytes, 4 * 1024 * 1024)),
               ("grpc.max_concurrent_streams", limits.per_connection),
               ("grpc.so_reuseport", 0),
               # no bandwidth-delay probing: with it gRPC's core raised every stream's HTTP/2 window to 32-64
               # MiB, so a call's whole message was received and held before any servicer code ran, and a
               # call waiting in Send's reservation (the message unread) still took its 8 MiB. Without it a
               # stream not being read holds at most 64 KiB, one being read a window of about 1 MiB.
               ("grpc.http2.bdp_probe", 0),
               # a connection is a file descriptor of the process HTTP shares (H38): one that has not
               # completed its HTTP/2 handshake within http_header_timeout_s (as an HTTP request head must),
               # or that has no call for grpc_stream_idle_timeout_s, is closed (GOAWAY; a client reconnects on
               # its next call), and at most max_connections() are open. Before stop 43 idle connections were
               # held for ever (without a handshake for 120 s) and unbounded, so they could take every
               # descriptor, and with them HTTP's and every tenant's ingest.
               ("grpc.server_handshake_timeout_ms", max(1, int(settings.http_header_timeout_s * 1000))),
               ("grpc.max_connection_idle_ms", max(1, int(limits.idle_timeout_s * 1000))),
               ("grpc.max_allowed_incoming_connections", max_connections(settings))]
    server = GrpcIngestServer(gateway, host, port, options, limits,
                              workers if workers is not None else settings.grpc_workers)
    return server, server.port
