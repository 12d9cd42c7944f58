"""The transport-independent ingest core: auth → decode → validate → de-duplicate → queue → per-item result.

Contract of :class:`Gateway` (HTTP and gRPC are thin adapters over it):

* **Auth.** Every request carries a bearer token. None/empty → :class:`Unauthenticated`; a token the
  :class:`~trainguard_server.storage.base.ProjectStore` does not know (or revoked) → :class:`Unauthenticated`;
  a read token → :class:`PermissionDenied` ("token is not an ingest token"). Events are scoped to the token's
  project (an event naming another project is rejected ``wrong_project``; an empty one is filled in).
* **Per-item semantics.** A request is never all-or-nothing because of its *content*: each event is validated
  on its own (:mod:`.validate`) and the good events are queued even when others in the same request are
  rejected. Rejected events come back as ``rejected[{index, event_id, code, message}]`` and are never queued;
  re-sending them cannot help. Only whole-request problems fail the request: auth, an undecodable body,
  more than ``max_batch_events`` events (:class:`RequestTooLarge`), and the queue refusing the batch.
* **Duplicates.** An ``event_id`` seen earlier in the same request (or the same gRPC stream) is counted in
  ``duplicates`` and not queued again. Across requests, idempotency is downstream: the stores keep each
  ``event_id`` once, so a re-sent batch is safe (the gateway does not remember earlier requests).
* **Ordering and durability.** Accepted events are grouped by ``run_id``; each group is published as ONE
  serialized ``IngestRequest`` with ``key = run_id`` (events in request order), so a run's events stay in
  order in the queue. The result is returned only after every ``Queue.publish`` returned, i.e. once durable.
* **Backpressure.** ``QueueFull`` → :class:`Backpressure` (``retry_after`` seconds): for a single-run batch
  (what one SDK process sends) nothing of it was queued; the client retries the whole batch. When one batch
  holds several runs, the groups published before the queue filled stay queued — a retry is still safe
  (idempotent by ``event_id``). Any other publish failure (disk full, broker down) → :class:`Unavailable`.
* **Zero-copy fast path.** When the request's serialized bytes are known (HTTP protobuf, gRPC) and every
  event is accepted unchanged and belongs to one run, those exact bytes are what gets queued.
* **Clocks.** A request's ``x-trainguard-sent-at`` far off the gateway's clock shifts its event times by the
  difference before validation (:mod:`.sent_at`, ``clock_skew_correct_s``); a malformed one is
  :class:`InvalidRequest`.
* :attr:`Gateway.stats` counts requests, accepted, duplicates, rejected (by code), backpressure, bytes.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from trainguard import wire
from trainguard.v1 import ingest_pb2

from .. import request_headers
from ..config import Settings
from ..json_keys import unique_keys
from ..queue.base import Queue, QueueFull
from ..storage.base import OutOfFiles, ProjectStore, TokenInfo, format_ns
from .backlog import ProjectBacklog, weight
from .body_count import ProjectBodies
from .deep_json import TooDeep, split_events_json
from .inflight import InflightBytes
from .log_window import LogWindow
from .metric_names import MetricNameCap, Seed
from .point_names import PointNames, Shape
from .run_rate import NewRunLimiter
from .sent_at import clock_offset, shift_times
from .validate import Limits, validate_batch

_log = logging.getLogger(__name__)

__all__ = [
    "Backpressure",
    "Batch",
    "Gateway",
    "GatewayError",
    "IngestResult",
    "InvalidRequest",
    "PermissionDenied",
    "RejectedItem",
    "RequestTooLarge",
    "Stats",
    "Unauthenticated",
    "Unavailable",
    "batch_from_json",
    "batch_from_protobuf",
    "bearer_token",
    "one_authorization",
    "retry_after_header",
]

IngestRequest = ingest_pb2.IngestRequest


# ------------------------------------------------------------------------------------------------ errors

class GatewayError(Exception):
    """A whole-request failure; ``str(err)`` is the message for the client."""


class Unauthenticated(GatewayError):
    """No token, or one the project store does not know (or that was revoked). HTTP 401 / UNAUTHENTICATED."""


class PermissionDenied(GatewayError):
    """A valid token that may not ingest (a read token). HTTP 403 / PERMISSION_DENIED."""


class InvalidRequest(GatewayError):
    """The request itself is unusable (undecodable, no events array). HTTP 400 / INVALID_ARGUMENT."""


class RequestTooLarge(GatewayError):
    """Too many bytes or events in one request: split it. HTTP 413 / RESOURCE_EXHAUSTED "larger than max"."""


class Backpressure(GatewayError):
    """The queue is full: retry the whole batch after ``retry_after`` s. HTTP 429 / RESOURCE_EXHAUSTED."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(GatewayError):
    """The queue failed (disk full, broker down): retry after ``retry_after`` s. HTTP 503 / UNAVAILABLE."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def retry_after_header(seconds: float) -> str:
    """``Retry-After`` / ``retry-after`` value: whole seconds (HTTP delta-seconds), at least 1."""
    return str(max(1, math.ceil(seconds)))


def one_authorization(values: Sequence[str]) -> Optional[str]:
    """The one ``Authorization`` value of a request (None without one); :class:`Unauthenticated` for more
    than one: which token counts would be a guess (a proxy may read another one than the gateway). The rule
    and its message are :func:`..request_headers.one_authorization`'s (the query API's too)."""
    try:
        return request_headers.one_authorization(values, "ingest")
    except request_headers.HeaderConflict as exc:
        raise Unauthenticated(str(exc)) from None


def bearer_token(authorization: Optional[str]) -> Optional[str]:
    """The token of an ``Authorization: Bearer <token>`` value; None when absent; raises
    :class:`Unauthenticated` for another scheme or an empty token."""
    if authorization is None or not authorization.strip():
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        raise Unauthenticated(f"authorization scheme {scheme!r} is not supported; "
                              f"use 'Bearer <ingest token>'")
    token = token.strip()
    if not token:
        raise Unauthenticated("empty bearer token")
    return token


# ----------------------------------------------------------------------------------------------- results

@dataclass(frozen=True)
class RejectedItem:
    """One refused event: its position in the request (or stream), id, code and message."""

    index: int
    event_id: str
    code: str
    message: str

    def to_dict(self) -> Dict[str, Any]:
        return {"index": self.index, "event_id": wire.utf8_safe(self.event_id), "code": self.code,
                "message": wire.utf8_safe(self.message)}


@dataclass
class IngestResult:
    """Per-item outcome of an acknowledged request (the wire's ``IngestResponse``)."""

    accepted: int = 0
    duplicates: int = 0
    rejected: List[RejectedItem] = field(default_factory=list)

    def merge(self, other: IngestResult) -> None:
        """Add ``other`` (a later message of the same stream) to this result."""
        self.accepted += other.accepted
        self.duplicates += other.duplicates
        self.rejected.extend(other.rejected)

    def to_dict(self) -> Dict[str, Any]:
        return {"accepted": self.accepted, "duplicates": self.duplicates,
                "rejected": [r.to_dict() for r in self.rejected]}

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), ensure_ascii=False).encode()

    def to_proto(self) -> ingest_pb2.IngestResponse:
        return ingest_pb2.IngestResponse(accepted=self.accepted, duplicates=self.duplicates,
                                         rejected=[r.to_dict() for r in self.rejected])


# -------------------------------------------------------------------------------------------- raw split

def _raw_request_class() -> Any:
    """``IngestRequest`` seen as ``repeated bytes events = 1``: splits a serialized request into its
    serialized envelopes at C speed (no per-event parsing), and joins them back."""
    proto = descriptor_pb2.FileDescriptorProto(name="trainguard_server/gateway/raw_ingest.proto",
                                               package="trainguard_server.gateway", syntax="proto3")
    message = proto.message_type.add(name="RawIngestRequest")
    message.field.add(name="events", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
                      label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    descriptor = pool.FindMessageTypeByName("trainguard_server.gateway.RawIngestRequest")
    return message_factory.GetMessageClass(descriptor)


_RawIngestRequest = _raw_request_class()


def split_events(raw: bytes) -> List[bytes]:
    """The serialized envelopes of serialized ``IngestRequest`` ``raw``, in order (DecodeError if the
    framing is broken)."""
    return list(_RawIngestRequest.FromString(raw).events)


def join_events(parts: Sequence[bytes]) -> bytes:
    """A serialized ``IngestRequest`` of serialized envelopes ``parts`` (inverse of :func:`split_events`)."""
    return bytes(_RawIngestRequest(events=parts).SerializeToString())


# ------------------------------------------------------------------------------------------------ batch

@dataclass
class Batch:
    """A decoded request, ready for :meth:`Gateway.ingest_batch`.

    ``request.events[k]`` is event ``indices[k]`` of the client's request (``indices`` None: ``k``);
    ``raw``, when known, is exactly ``request`` serialized (what the client sent); ``rejected`` are events
    refused while decoding (indexed in the client's request); ``count`` is the number of events the
    client sent; ``wire_bytes`` the decoded body size; ``clock_offset_ns`` is added to every event time
    before validation (:meth:`Gateway.clock_offset`, :mod:`.sent_at`).
    """

    request: ingest_pb2.IngestRequest
    raw: Optional[bytes] = None
    indices: Optional[List[int]] = None
    rejected: List[RejectedItem] = field(default_factory=list)
    count: int = -1
    wire_bytes: int = 0
    clock_offset_ns: int = 0

    def __post_init__(self) -> None:
        if self.count < 0:
            self.count = len(self.request.events) + len(self.rejected)


def batch_from_protobuf(raw: bytes) -> Batch:
    """Decode a serialized ``IngestRequest``.

    When the request parses, it is used as is. When it does not but its framing does (one envelope inside is
    corrupt, e.g. bad UTF-8, or nested one level too deep to parse inside a request), each envelope is parsed
    alone, framed as a one-event request (the nesting it has in the request), and the corrupt ones are
    rejected per item (``invalid_field``), so the good ones are not lost. Only a broken framing raises
    :class:`InvalidRequest`.
    """
    try:
        return Batch(IngestRequest.FromString(raw), raw=raw, wire_bytes=len(raw))
    except DecodeError as exc:
        whole_error = _decode_reason(exc)
    try:
        parts = split_events(raw)
    except DecodeError:
        raise InvalidRequest(f"malformed protobuf: body is not a serialized trainguard.v1.IngestRequest "
                             f"({whole_error})") from None
    good: List[bytes] = []
    indices: List[int] = []
    rejected: List[RejectedItem] = []
    for i, part in enumerate(parts):
        try:  # as it will be parsed: inside a request (one nesting level more than alone; upb's limit is 100)
            IngestRequest.FromString(join_events([part]))
        except DecodeError as exc:
            rejected.append(RejectedItem(i, "", "invalid_field",
                                         f"events[{i}]: malformed protobuf: {_decode_reason(exc)}"))
            continue
        good.append(part)
        indices.append(i)
    good_raw = join_events(good)
    return Batch(IngestRequest.FromString(good_raw), raw=good_raw, indices=indices, rejected=rejected,
                 count=len(parts), wire_bytes=len(raw))


def _decode_reason(exc: Exception) -> str:
    text = str(exc)
    # upb: "Error parsing message with type 'X': Wire format was corrupt"
    _, sep, reason = text.partition("': ")
    return reason if sep else (text or "cannot parse")


def _reject_nan_tokens(token: str) -> Any:
    raise ValueError(f"bare {token} is not valid JSON (write the string \"{token}\")")


def _json_error(exc: ValueError) -> str:
    """The client's message for a body ``json.loads`` refused (Python's own advice left out)."""
    digits = re.match(r"Exceeds the limit \((\d+) digits\) for integer string conversion(?:: value has "
                      r"(\d+) digits)?", str(exc))
    if digits:
        has = f" of {digits.group(2)} digits" if digits.group(2) else ""
        return (f"malformed JSON: a number{has} is longer than the {digits.group(1)} digits a JSON number "
                f"may have here (an int64 has at most 19)")
    return f"malformed JSON: {exc}"


_JSON_DECODER = json.JSONDecoder(parse_constant=_reject_nan_tokens, object_pairs_hook=unique_keys)


def batch_from_json(body: bytes, *, max_events: int) -> Batch:
    """Decode a JSON ``{"events": [<envelope>, ...]}`` body (the proto3 JSON mapping, strict).

    Whole-body problems raise :class:`InvalidRequest` (not UTF-8 / not JSON / not an object / no ``events``
    array / an unknown top-level field) or :class:`RequestTooLarge` (over ``max_events`` events). An
    envelope that does not fit the schema (unknown field, wrong type, ...) is rejected per item with code
    ``invalid_field`` and the field path (``events[3].metrics.points[1]: unknown field "vaule" ...``) -- also
    one nested too deeply for the JSON decoder (``events[1].tags: JSON nested 5000 levels deep ...``, see
    :mod:`.deep_json`): the other events of the batch are kept.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"malformed JSON: body is not valid UTF-8 ({exc.reason} at byte "
                             f"{exc.start})") from None
    try:
        doc = _JSON_DECODER.decode(text)
    except ValueError as exc:
        raise InvalidRequest(_json_error(exc)) from None
    except RecursionError:  # nested ~1,000 deep somewhere: decode event by event
        return _batch_from_deep_json(text, len(body), max_events)
    if not isinstance(doc, dict):
        raise InvalidRequest(f'IngestRequest: expected an object with an "events" array, got {_kind(doc)}')
    unknown = [k for k in doc if k != "events"]
    if unknown:
        raise InvalidRequest(f'IngestRequest: unknown field {json.dumps(unknown[0])} '
                             f'(trainguard.v1.IngestRequest has: events)')
    events = doc.get("events")
    if events is None:
        raise InvalidRequest('IngestRequest.events: required (an array of envelopes)')
    if not isinstance(events, list):
        raise InvalidRequest(f"IngestRequest.events: expected an array, got {_kind(events)}")
    if len(events) > max_events:
        raise RequestTooLarge(_too_many_events(len(events), max_events))
    prepared = wire.prepare_batch(events)
    rejected = [RejectedItem(int(r["index"]), str(r["event_id"]), str(r["code"]),
                             _events_path(int(r["index"]), str(r["message"])))
                for r in prepared.rejected]
    indices = prepared.indices if rejected else None
    return Batch(prepared.request, indices=indices, rejected=rejected, count=len(events),
                 wire_bytes=len(body))


def _batch_from_deep_json(text: str, wire_bytes: int, max_events: int) -> Batch:
    """:func:`batch_from_json` for a body ``json.loads`` cannot decode for its depth: the events nested too
    deeply are rejected per item (``invalid_field``), the others decoded and converted as usual."""
    try:
        events = split_events_json(text, _JSON_DECODER)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    if len(events) > max_events:
        raise RequestTooLarge(_too_many_events(len(events), max_events))
    positions = [i for i, e in enumerate(events) if not isinstance(e, TooDeep)]
    prepared = wire.prepare_batch([events[i] for i in positions])
    rejected = [RejectedItem(positions[int(r["index"])], str(r["event_id"]), str(r["code"]),
                             _events_path(positions[int(r["index"])], str(r["message"])))
                for r in prepared.rejected]
    for i, e in enumerate(events):
        if isinstance(e, TooDeep):
            where = f"events[{i}]" + (f".{e.field}" if e.field else "")
            rejected.append(RejectedItem(i, e.event_id, "invalid_field",
                                         f"{where}: JSON nested {e.depth} levels deep, too deep to decode "
                                         f"(an envelope nests a few levels)"))
    rejected.sort(key=lambda r: r.index)
    return Batch(prepared.request, indices=[positions[k] for k in prepared.indices], rejected=rejected,
                 count=len(events), wire_bytes=wire_bytes)


def _events_path(index: int, message: str) -> str:
    """``Envelope.x.y: reason`` (trainguard.wire's path) → ``events[i].x.y: reason``."""
    if message.startswith("Envelope"):
        return f"events[{index}]{message[len('Envelope'):]}"
    return f"events[{index}]: {message}"


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return "null" if value is None else json.dumps(value)[:40]


def _too_many_events(count: int, limit: int) -> str:
    # "larger than max" is what makes the SDK split a batch instead of retrying it (gRPC and HTTP 413 alike)
    return f"request has {count} events, larger than max_batch_events={limit}; split the batch"


# ------------------------------------------------------------------------------------------------ stats

class Stats:
    """Gateway counters: plain ints updated under a lock; reading an attribute needs no lock, and
    ``rejected`` is replaced (never mutated) on update, so iterating it is safe too. :meth:`snapshot`
    reads them all at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0           # requests that reached validation (authenticated, decoded)
        self.accepted = 0           # events queued
        self.duplicates = 0         # events skipped as repeats within a request / stream
        self.rejected: Dict[str, int] = {}  # events refused, by code (copy-on-write)
        self.backpressure = 0       # requests refused with QueueFull
        self.new_run_limited = 0    # requests refused: their project started new runs too fast
        self.backlog_limited = 0    # requests refused: their project had too many events waiting
        self.unavailable = 0        # requests refused because the queue failed
        self.auth_failures = 0      # unauthenticated or permission denied
        self.bytes_received = 0     # decoded request bytes that reached validation
        self.bytes_queued = 0       # bytes published to the queue

    def add(self, **deltas: int) -> None:
        """Add to counters by name (``rejected`` takes no part; see :meth:`add_rejected`)."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def add_result(self, result: IngestResult, received: int, queued: int) -> None:
        with self._lock:
            self.requests += 1
            self.accepted += result.accepted
            self.duplicates += result.duplicates
            self.bytes_received += received
            self.bytes_queued += queued
            if result.rejected:
                rejected = Counter(self.rejected)
                rejected.update(item.code for item in result.rejected)
                self.rejected = dict(rejected)

    @property
    def bytes(self) -> int:
        """Request bytes received (alias of ``bytes_received``)."""
        return self.bytes_received

    def snapshot(self) -> Dict[str, Any]:
        """All counters; ``rejected`` as ``{code: n}``."""
        with self._lock:
            return {"requests": self.requests, "accepted": self.accepted, "duplicates": self.duplicates,
                    "rejected": dict(self.rejected), "backpressure": self.backpressure,
                    "new_run_limited": self.new_run_limited, "backlog_limited": self.backlog_limited,
                    "unavailable": self.unavailable, "auth_failures": self.auth_failures,
                    "bytes_received": self.bytes_received, "bytes_queued": self.bytes_queued}


# ---------------------------------------------------------------------------------------------- gateway

class Gateway:
    """Authenticates, validates and queues ingest requests (see the module docstring for the contract).

    Thread-safe: transports call it from many threads at once. ``clock`` gives the receive time (ns).
    ``backlog``: the per-project bound on events waiting for this process's processor (None: not counted;
    :mod:`.backlog`). ``metric_names``: a run's metric names already stored (the metric store's ``names``,
    where this process shares it), where :mod:`.metric_names` starts counting a run it does not remember.
    """

    def __init__(self, queue: Queue, projects: ProjectStore, settings: Settings, *,
                 clock: Callable[[], int] = time.time_ns, backlog: Optional[ProjectBacklog] = None,
                 metric_names: Optional[Seed] = None) -> None:
        self.queue = queue
        self.projects = projects
        self.settings = settings
        self.limits = Limits.from_settings(settings)
        self.clock = clock
        self.stats = Stats()
        self.new_runs = NewRunLimiter(settings.project_new_runs_per_s, settings.project_new_runs_burst,
                                      settings.project_known_runs)
        self.backlog = backlog if backlog is not None and backlog.enabled else None
        self.metric_names = MetricNameCap(settings.run_max_metric_names, settings.metric_names_memory_bytes,
                                          seed=metric_names, max_length=settings.max_metric_name_length)
        self.point_names = PointNames()
        total, per_project = settings.ingest_max_inflight_bytes, settings.project_max_inflight_bytes
        #: HTTP ingest bodies held (read or being decoded), in all and per project (:mod:`.inflight`)
        self.body_bytes: Optional[InflightBytes] = (
            InflightBytes(total, per_project, settings.max_batch_bytes) if total or per_project else None)
        #: HTTP ingest bodies being read, per project (:mod:`.body_count`; security.md H43)
        self.http_bodies = ProjectBodies(settings.project_max_http_bodies)
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        #: token checks refused for want of descriptors: one log line per 10 s, however many a burst refuses
        self._out_of_files_log = LogWindow(10.0)

    @property
    def busy(self) -> bool:
        """True while a request is being ingested: the embedded processor yields the GIL meanwhile."""
        return self._inflight > 0

    # ------------------------------------------------------------------------------------------ auth
    def authenticate(self, token: Optional[str]) -> TokenInfo:
        """The ingest token's info; :class:`Unauthenticated` / :class:`PermissionDenied` otherwise."""
        if not token:
            self.stats.add(auth_failures=1)
            raise Unauthenticated("missing bearer token (send 'Authorization: Bearer <ingest token>')")
        try:
            info = self.projects.authenticate(token)
            expired = self.projects.expired_at(token) if info is None else 0
        except OutOfFiles as exc:  # a burst of connections holds every descriptor: 503, not 500 (H46)
            self.stats.add(unavailable=1)
            self._log_out_of_files(exc)
            wait = self.settings.retry_after_s
            raise Unavailable(f"the server cannot check tokens now: {exc.reason}; nothing of this request "
                              f"was queued; retry after {retry_after_header(wait)} s", wait) from None
        if info is None:
            self.stats.add(auth_failures=1)
            if expired:
                raise Unauthenticated(f"token expired at {format_ns(expired)}: create a new one")
            raise Unauthenticated("invalid or revoked token")
        if info.kind != "ingest":
            self.stats.add(auth_failures=1)
            raise PermissionDenied("token is not an ingest token")
        if self.backlog is not None and self.backlog.full(info.project):
            self._backlog_refusal(info.project, self.backlog.retry_after_s)
        return info

    def _log_out_of_files(self, exc: OutOfFiles) -> None:
        count = self._out_of_files_log.due()
        if not count:
            return
        _log.warning("token check answered 503 (%d since the last such line, one a 10 s): %s", count, exc)

    def _backlog_refusal(self, project: str, wait: float) -> None:
        """Refuse a request of ``project``: it has its bound's worth of events waiting (:mod:`.backlog`)."""
        assert self.backlog is not None
        self.stats.add(backlog_limited=1)
        raise Backpressure(f"project {project!r} has {self.backlog.waiting(project)} events waiting for the "
                           f"processor, at most {self.backlog.limit} may "
                           "(TRAINGUARD_PROJECT_MAX_BACKLOG_EVENTS; a metric batch counts one per point): "
                           "nothing of this request was queued; "
                           f"retry after {retry_after_header(wait)} s", wait)

    def clock_offset(self, sent_at: Sequence[str]) -> int:
        """The shift (ns) for the event times of a request received now whose ``x-trainguard-sent-at``
        values are ``sent_at`` (:mod:`.sent_at`); :class:`InvalidRequest` when they are malformed."""
        try:
            return clock_offset(sent_at, self.clock(), self.settings.clock_skew_correct_s)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None

    # ---------------------------------------------------------------------------------------- ingest
    def ingest(self, token: Optional[str], request: ingest_pb2.IngestRequest, *,
               raw: Optional[bytes] = None) -> IngestResult:
        """Authenticate ``token`` and ingest ``request`` (``raw``: its exact serialized form, if known)."""
        info = self.authenticate(token)
        return self.ingest_batch(info, Batch(request, raw=raw, wire_bytes=len(raw) if raw is not None else 0))

    def ingest_batch(self, auth: TokenInfo, batch: Batch, *, index_offset: int = 0,
                     seen: Optional[Set[str]] = None) -> IngestResult:
        """Validate and queue a decoded batch for an authenticated token; the per-item result.

        ``index_offset`` shifts every reported index (a stream's earlier messages); ``seen`` holds the
        event ids accepted earlier in the same stream and is updated (None: this request alone).
        """
        with self._inflight_lock:
            self._inflight += 1
        try:
            return self._ingest_batch(auth, batch, index_offset, seen)
        finally:
            with self._inflight_lock:
                self._inflight -= 1

    def _ingest_batch(self, auth: TokenInfo, batch: Batch, index_offset: int,
                      seen: Optional[Set[str]]) -> IngestResult:
        limit = self.settings.max_batch_events
        if batch.count > limit:
            raise RequestTooLarge(_too_many_events(batch.count, limit))
        request = batch.request
        events = list(request.events)
        raw = batch.raw if batch.raw is not None else request.SerializeToString()
        total = len(raw)
        parts: Optional[List[bytes]] = None

        def sizes() -> List[int]:
            nonlocal parts
            if parts is None:
                parts = split_events(raw)
            return list(map(len, parts))

        points = _Points(self.point_names, raw, events) \
            if events and (self.backlog is not None or self.metric_names.enabled) else None
        shifted = shift_times(events, batch.clock_offset_ns) if batch.clock_offset_ns else ()
        verdict = validate_batch(events, project=auth.project, now_ns=self.clock(), limits=self.limits,
                                 total_bytes=total, sizes=sizes, index_offset=index_offset,
                                 indices=batch.indices, kinds=points.kinds() if points is not None else None)
        if shifted:  # their bytes as received carry the host's times
            verdict.mutated.update(shifted)
        ids = verdict.event_ids
        result = IngestResult(rejected=[RejectedItem(r.index + index_offset, r.event_id, r.code,
                                                     _shift(r.message, r.index, index_offset))
                                        for r in batch.rejected])
        position = batch.indices
        for k, rejection in verdict.rejected.items():
            index = (position[k] if position is not None else k) + index_offset
            result.rejected.append(RejectedItem(index, ids[k], rejection.code, rejection.message))

        accepted: List[int]
        if not verdict.rejected and seen is None and len(set(ids)) == len(ids):
            accepted = list(range(len(events)))  # the common case: every event new and valid
        else:
            accepted = []
            known = seen if seen is not None else set()
            for k, event_id in enumerate(ids):
                if k in verdict.rejected:
                    continue
                if event_id in known:
                    result.duplicates += 1
                    continue
                known.add(event_id)
                accepted.append(k)
        if len(result.rejected) > 1:
            result.rejected.sort(key=lambda r: r.index)
        result.accepted = len(accepted)
        run_ids = verdict.run_ids
        if accepted and self.new_runs.enabled:
            every = len(accepted) == len(events)
            runs: Any = (run_ids[:1] if run_ids.count(run_ids[0]) == len(run_ids) else run_ids) if every \
                else (run_ids[k] for k in accepted)
            wait = self.new_runs.admit(auth.project, runs, self.clock())
            if wait is not None:
                self.stats.add(new_run_limited=1)
                raise Backpressure(f"project {auth.project!r} is starting new runs faster than "
                                   f"{self.settings.project_new_runs_per_s:g}/s (burst "
                                   f"{self.settings.project_new_runs_burst}; "
                                   "TRAINGUARD_PROJECT_NEW_RUNS_PER_S): nothing of this request was queued; "
                                   f"retry after {retry_after_header(wait)} s", wait)
        if not accepted:
            points = None
        elif points is not None:
            points.accept(accepted)
        if points is not None and self.backlog is not None:
            wait = self.backlog.admit(auth.project, points.weight())
            if wait is not None:
                self._backlog_refusal(auth.project, wait)
        if points is not None and self.metric_names.enabled:
            accepted = self._cap_metric_names(auth.project, events, accepted, verdict.run_ids, batch.indices,
                                              index_offset, result, points)

        queued = self._publish(events, accepted, verdict.run_ids, verdict.mutated, request, raw, parts,
                               auth.project)
        self.stats.add_result(result, batch.wire_bytes or total, queued)
        return result

    def _cap_metric_names(self, project: str, events: List[Any], accepted: List[int], run_ids: List[str],
                          position: Optional[List[int]], index_offset: int,
                          result: IngestResult, points: _Points) -> List[int]:
        """``accepted`` less the metric batches refused for their run's distinct names or a name too long
        (:mod:`.metric_names`), each added to ``result`` as a rejection; the backlog counted for them is
        released."""
        if self.metric_names.admits_known(project, points.names_by_run(run_ids)):
            return accepted  # the steady state: every run names only what it has
        refused = self.metric_names.refusals(project, points.items(run_ids))
        if not refused:
            return accepted
        for k, (code, message) in refused.items():
            index = (position[k] if position is not None else k) + index_offset
            result.rejected.append(RejectedItem(index, events[k].event_id, code,
                                                f"events[{index}].{message}"))
        result.rejected.sort(key=lambda r: r.index)
        result.accepted -= len(refused)
        if self.backlog is not None:
            self.backlog.release(project, sum(weight(events[k]) for k in refused))
        return [k for k in accepted if k not in refused]

    # --------------------------------------------------------------------------------------- publish
    def _publish(self, events: List[Any], accepted: List[int], run_ids: List[str], mutated: Set[int],
                 request: Any, raw: bytes, parts: Optional[List[bytes]], project: str) -> int:
        """Publish the accepted events, one serialized IngestRequest per run; returns the bytes queued.
        Events counted in the project's backlog and not published (the queue refused them) are released."""
        if not accepted:
            return 0
        groups: Dict[str, List[int]] = {}
        first_run = run_ids[accepted[0]]
        if run_ids.count(first_run) == len(run_ids) and len(accepted) == len(events):
            groups[first_run] = accepted
        else:
            for k in accepted:
                groups.setdefault(run_ids[k], []).append(k)
        values: List[Tuple[str, bytes]] = []  # in the order of ``groups``
        if len(groups) == 1 and len(accepted) == len(events):
            # zero-copy when nothing was normalised: exactly the bytes the client sent
            values.append((first_run, request.SerializeToString() if mutated else raw))
        else:
            if parts is None:
                parts = split_events(raw)
            if len(parts) != len(events):  # pragma: no cover - a framing the split cannot mirror
                parts = [e.SerializeToString() for e in events]
            for k in mutated:
                parts[k] = events[k].SerializeToString()
            for run_id, members in groups.items():
                values.append((run_id, join_events([parts[k] for k in members])))
        queued = 0
        for i, (run_id, value) in enumerate(values):
            try:
                self._publish_one(run_id, value)
            except GatewayError:
                if self.backlog is not None:  # this run's and the later runs' events were not queued
                    unpublished = list(groups.values())[i:]
                    self.backlog.release(project, sum(weight(events[k]) for ks in unpublished for k in ks))
                raise
            queued += len(value)
        return queued

    def _publish_one(self, run_id: str, value: bytes) -> None:
        """One run's record to the queue; a refusal as :class:`Backpressure` (full) / :class:`Unavailable`."""
        try:
            self.queue.publish(run_id, [value])
        except QueueFull as exc:
            self.stats.add(backpressure=1)
            raise Backpressure(f"ingest queue is full ({exc}); retry after "
                               f"{retry_after_header(exc.retry_after)} s", exc.retry_after) from None
        except Exception as exc:
            self.stats.add(unavailable=1)
            raise Unavailable(f"ingest queue unavailable: {type(exc).__name__}: {exc}",
                              self.settings.retry_after_s) from None


class _Points:
    """The accepted envelopes' metric points, as the backlog and the name bound count them: read from the
    request's shapes (:mod:`.point_names`, C speed) or, where the view cannot read it, from the envelopes.
    Equal by construction to :func:`.backlog.weight` and ``[p.name for p in e.metrics.points]`` of each
    accepted envelope ``e`` whose payload is a metric batch."""

    def __init__(self, reader: PointNames, raw: bytes, events: List[Any]) -> None:
        self.reader = reader
        self.events = events
        self.accepted = list(range(len(events)))
        self.every = True
        self.uniform: Optional[Shape] = None  # every envelope has this shape
        self.shapes: Optional[List[bytes]] = None  # else one per envelope
        self._decoded: Dict[bytes, Shape] = {}  # this request's shapes decoded (large ones are not cached)
        names_only = reader.names_only(raw)
        if names_only is None:
            return
        one = reader.uniform(names_only, len(events))
        if one is not None:
            self.uniform = reader.shape(one)
        else:
            self.shapes = reader.split(names_only, len(events))

    def _shape(self, shape: bytes) -> Shape:
        got = self._decoded.get(shape)
        if got is None:
            got = self._decoded[shape] = self.reader.shape(shape)
        return got

    def accept(self, accepted: List[int]) -> None:
        """From now on count only ``accepted`` (positions in ``events``)."""
        self.accepted = accepted
        self.every = len(accepted) == len(self.events)

    def kinds(self) -> Optional[List[Optional[str]]]:
        """Every envelope's ``WhichOneof('payload')``, when the shapes tell (else None)."""
        if self.uniform is not None:  # else reading the envelopes costs no more
            return [self.uniform.kind] * len(self.events)
        return None

    def _counts(self) -> Optional[Dict[bytes, int]]:
        """How many accepted envelopes have each shape (None: no shapes)."""
        if self.shapes is None:
            return None
        if self.every:
            return Counter(self.shapes)
        return Counter(map(self.shapes.__getitem__, self.accepted))

    def weight(self) -> int:
        """What the accepted envelopes count in the project's backlog."""
        if self.uniform is not None:
            return self.uniform.weight * len(self.accepted)
        counts = self._counts()
        if counts is None:
            return sum(weight(self.events[k]) for k in self.accepted)
        shape = self._shape
        return sum(shape(s).weight * n for s, n in counts.items())

    def _shape_of(self, k: int) -> Shape:
        if self.uniform is not None:
            return self.uniform
        if self.shapes is not None:
            return self._shape(self.shapes[k])
        envelope = self.events[k]
        if envelope.WhichOneof("payload") != "metrics":
            return _NOT_METRICS
        return Shape(True, tuple(p.name for p in envelope.metrics.points), weight(envelope))

    def names_by_run(self, run_ids: List[str]) -> Dict[str, Set[str]]:
        """Run id -> the names its accepted metric batches carry (empty names left out), runs in the order
        of their first metric batch."""
        accepted = self.accepted
        runs_of = run_ids if self.every else list(map(run_ids.__getitem__, accepted))
        out: Dict[str, Set[str]] = {}
        if self.uniform is not None:
            if not self.uniform.metrics:
                return out
            names = set(self.uniform.names)
            names.discard("")
            if runs_of.count(runs_of[0]) == len(runs_of):  # one run (an SDK process's request)
                return {runs_of[0]: names}
            return {run_id: names for run_id in dict.fromkeys(runs_of)}
        if self.shapes is not None:
            shapes_of = self.shapes if self.every else list(map(self.shapes.__getitem__, accepted))
            pairs: Any = dict.fromkeys(zip(runs_of, shapes_of))
            shape: Callable[[Any], Shape] = self._shape
        else:
            pairs = ((run_ids[k], k) for k in accepted)
            shape = self._shape_of
        for run_id, s in pairs:
            got = shape(s)
            if got.metrics:
                out.setdefault(run_id, set()).update(got.names)
        for names in out.values():
            names.discard("")
        return out

    def items(self, run_ids: List[str]) -> List[Tuple[int, str, Tuple[str, ...]]]:
        """``(k, run_id, names)`` of the accepted metric batches, in request order (:mod:`.metric_names`)."""
        out = []
        for k in self.accepted:
            got = self._shape_of(k)
            if got.metrics:
                out.append((k, run_ids[k], got.names))
        return out


_NOT_METRICS = Shape(False, (), 1)


def _shift(message: str, index: int, offset: int) -> str:
    """Re-index a decode-time message ``events[index]...`` for a stream position."""
    if not offset:
        return message
    prefix = f"events[{index}]"
    return f"events[{index + offset}]" + message[len(prefix):] if message.startswith(prefix) else message
