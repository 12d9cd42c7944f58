"""Queue records → envelope dicts and their metric points, in one pass over the protobuf messages.

The processor needs, for every envelope of a record, the dict of the JSON mapping (what the pipeline and
the raw-context store read: :func:`trainguard.wire.envelope_to_dict`) and, for metric batches, the points
``(name, step, value)`` as :func:`trainguard_engine.extract.metric_points` reads them from that dict.
Most envelopes are plain metric batches (no alert, no recent context); for those both are built here
straight from the message -- the points' fields are read once, for the dict and the tuples together --
instead of a generic message walk followed by a second pass over the dicts (about half the cost on
SDK-shaped streams; bench/processor.py). Every other envelope takes the generic path. The result is the
same as the generic path's, field for field (tests/services/processor/test_decode.py checks it on the
recorded streams).

The embedded processor goes one step further (:func:`read_request`): a plain metric batch becomes a
:class:`~trainguard_engine.pipeline.ReadEnvelope` -- the header fields the pipeline reads, taken from the
message, and the points -- with no dict built at all: its ``raw`` and ``body`` are read-only mappings equal
to the JSON mapping's (key order included), each value read from the message when asked for (nothing in
the processor asks: the per-project backlog is handed its project and ``PlainBatch.count``,
embedded.backlog_counts). The pipeline takes it as read, the metric store takes its points and its header
fields. Those
mappings keep no protobuf message alive: they hold the record's bytes (which the processor holds anyway
until its checkpoint) and the envelope's index, and parse the record again -- once, shared by its
envelopes -- only when one of them is asked for something (a message read from Python keeps its whole
request's parse arena alive: held for a round's ~8,000 envelopes that was ~1-2 us per envelope in
allocation and release; bench/processor.py sdk16).

Reading through protobuf costs a Python object per message and per field read (upb: ~0.5 us a point, ~2 us
an envelope's header and wrappers). Where the package was built with its native reader (_fastread.c, our
own C; processor/native.py builds it, :data:`NATIVE`), read_request takes a request's plain batches straight
from its bytes in one call -- header values, and each point's ``(name, step, value)`` with one str per
distinct name -- and the memory envelopes' dicts (the SDK's periodic memory snapshots: ~4 us each through
protobuf, the whole request parsed and the generic conversion), and reads only its other envelopes through
protobuf; what it hands out is the same object
for object (tests/services/processor/test_fastread.py compares both on the recorded streams, hand-written
wire cases and random mutations). Without it (no compiler, another schema) everything goes through
protobuf: :func:`read_request_protobuf`.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

from trainguard import wire
from trainguard.v1 import ingest_pb2
from trainguard_engine import extract
from trainguard_engine.pipeline import ReadEnvelope, plain_body

Points = Optional[List[extract.MetricTuple]]
"""An envelope's metric points (None: not a metric batch)."""
Envelope = Union[Dict[str, Any], ReadEnvelope]
"""What :func:`read_request` gives for one envelope: its dict, or a plain metric batch already read."""


def _native_reader() -> Any:
    """The native reader (``_fastread``, built from _fastread.c with the package: processor/native.py);
    None without it, or when the generated schema is not the one it was written for."""
    try:
        from . import _fastread  # type: ignore[attr-defined]
    except ImportError:
        return None
    prepared = prepare_native(_fastread)
    if prepared is None:  # built, not for this source or schema: say so (the protobuf path reads all)
        logging.getLogger(__name__).warning(
            "the processor's native reader %s is not used: built from another source (VERSION %s, this code "
            "wants %s) or for another schema -- rebuild it: python -m trainguard_server.processor.native",
            getattr(_fastread, "__file__", "_fastread"), getattr(_fastread, "VERSION", None), READER_VERSION)
    return prepared


READER_VERSION = 7
"""The _fastread.c this decode.py was written with (its ``VERSION``): another build is not used."""
_READ_ENVELOPE_SLOTS = ("raw", "kind", "body", "event_id", "project", "run_id", "rank", "step", "time_ns",
                        "host", "pid", "world_size", "run_name", "trace_id")
"""ReadEnvelope's fields in its __init__'s order (the header ones in the native reader's order)."""
_PLAIN_BATCH_SLOTS = ("_record", "_index", "_dict", "count")
_PLAIN_ENVELOPE_SLOTS = ("_body", "_msg")


def prepare_native(module: Any) -> Any:
    """``module`` (a built _fastread) set up to build what :func:`read_request` hands out, or None when the
    schema or the classes are not the ones it was written for: ReadEnvelope a dataclass whose fields are
    exactly its slots, in :data:`_READ_ENVELOPE_SLOTS`' order, with no ``__post_init__`` (its generated
    __init__ then only assigns them, which is what the reader does); PlainBatch and PlainEnvelope this
    module's, with the slots their __init__s assign."""
    if getattr(module, "VERSION", None) != READER_VERSION or not schema_matches():
        return None  # a module built from another source (a stale build in place), or another schema
    if not dataclasses.is_dataclass(ReadEnvelope) or hasattr(ReadEnvelope, "__post_init__") or \
            tuple(f.name for f in dataclasses.fields(ReadEnvelope)) != _READ_ENVELOPE_SLOTS or \
            set(getattr(ReadEnvelope, "__slots__", ())) != set(_READ_ENVELOPE_SLOTS) or \
            set(PlainBatch.__slots__) != set(_PLAIN_BATCH_SLOTS) or \
            set(PlainEnvelope.__slots__) != set(_PLAIN_ENVELOPE_SLOTS):
        return None
    try:
        module.setup(ReadEnvelope, PlainBatch, PlainEnvelope,
                     *(tuple(cls.__dict__[name] for name in names)
                       for cls, names in ((ReadEnvelope, _READ_ENVELOPE_SLOTS),
                                          (PlainBatch, _PLAIN_BATCH_SLOTS),
                                          (PlainEnvelope, _PLAIN_ENVELOPE_SLOTS))))
    except (TypeError, KeyError, AttributeError):
        return None
    return module


def schema_matches() -> bool:
    """Whether the generated ``IngestRequest`` schema is the one _fastread.c was written for: the fields of
    Envelope, MetricBatch, Metric, MemorySnapshot and its ``stats`` entries -- every one, with its number,
    type and whether it repeats --, the payload oneof's members, the Severity names by number (a memory
    envelope's dict names its severity), a little-endian machine (doubles are copied from the wire as they
    are)."""
    from google.protobuf.descriptor import FieldDescriptor as F

    expected = {
        "Envelope": {"event_id": (1, F.TYPE_STRING), "project": (2, F.TYPE_STRING),
                     "run_id": (3, F.TYPE_STRING), "trace_id": (4, F.TYPE_STRING),
                     "host": (5, F.TYPE_STRING), "pid": (6, F.TYPE_INT32),
                     "rank": (7, F.TYPE_INT32), "local_rank": (8, F.TYPE_INT32),
                     "world_size": (9, F.TYPE_INT32), "step": (10, F.TYPE_INT64),
                     "time_unix_nano": (11, F.TYPE_INT64), "severity": (12, F.TYPE_ENUM),
                     "run_name": (13, F.TYPE_STRING), "sdk": (14, F.TYPE_STRING),
                     "group_rank": (15, F.TYPE_INT32), "metrics": (20, F.TYPE_MESSAGE),
                     "exception": (21, F.TYPE_MESSAGE), "lifecycle": (22, F.TYPE_MESSAGE),
                     "heartbeat": (23, F.TYPE_MESSAGE), "log": (24, F.TYPE_MESSAGE),
                     "memory": (25, F.TYPE_MESSAGE)},
        "MetricBatch": {"points": (1, F.TYPE_MESSAGE), "alert": (2, F.TYPE_STRING),
                        "recent": (3, F.TYPE_MESSAGE)},
        "Metric": {"name": (1, F.TYPE_STRING), "value": (2, F.TYPE_DOUBLE), "step": (3, F.TYPE_INT64)},
        "MemorySnapshot": {"device": (1, F.TYPE_STRING), "allocated": (2, F.TYPE_INT64),
                           "reserved": (3, F.TYPE_INT64), "active": (4, F.TYPE_INT64),
                           "max_allocated": (5, F.TYPE_INT64), "total_capacity": (6, F.TYPE_INT64),
                           "free": (7, F.TYPE_INT64), "fragmentation": (8, F.TYPE_DOUBLE),
                           "num_alloc_retries": (9, F.TYPE_INT64), "num_ooms": (10, F.TYPE_INT64),
                           "rss": (11, F.TYPE_INT64), "summary": (12, F.TYPE_STRING),
                           "stats": (13, F.TYPE_MESSAGE)},
        "StatsEntry": {"key": (1, F.TYPE_STRING), "value": (2, F.TYPE_DOUBLE)},
    }
    events: Any = ingest_pb2.IngestRequest.DESCRIPTOR.fields_by_name["events"]
    envelope: Any = events.message_type  # (message fields: a descriptor, never None)
    batch: Any = envelope.fields_by_name["metrics"].message_type
    metric: Any = batch.fields_by_name["points"].message_type
    memory: Any = envelope.fields_by_name["memory"].message_type if "memory" in envelope.fields_by_name \
        else None
    stats: Any = memory.fields_by_name["stats"].message_type if memory is not None and \
        "stats" in memory.fields_by_name else None
    if stats is None or not stats.GetOptions().map_entry:
        return False
    found: Dict[str, Any] = {"Envelope": envelope, "MetricBatch": batch, "Metric": metric,
                             "MemorySnapshot": memory, "StatsEntry": stats}
    repeated = {("MetricBatch", "points"), ("MetricBatch", "recent"), ("MemorySnapshot", "stats")}
    severity = envelope.fields_by_name["severity"].enum_type
    if events.number != 1 or events.type != F.TYPE_MESSAGE or not _repeats(events) or \
            sys.byteorder != "little" or {v.number: v.name for v in severity.values} != SEVERITY_NAMES:
        return False
    for name, fields in expected.items():
        have = {f.name: (f.number, f.type) for f in found[name].fields}
        if have != fields:
            return False
        for f in found[name].fields:
            if _repeats(f) != ((name, f.name) in repeated):
                return False
    if not (written_as_c_writes(envelope) and written_as_c_writes(memory)):
        return False
    payload = envelope.oneofs_by_name.get("payload")
    return payload is not None and sorted(f.number for f in payload.fields) == [20, 21, 22, 23, 24, 25]


def written_as_c_writes(message: Any) -> bool:
    """Whether wire.envelope_to_dict writes ``message``'s dict as _fastread.c does: its fields declared in
    field-number order (the C writes by number, wire by declaration) and no scalar with explicit presence
    (wire writes such a field even when 0; the C skips zeros) -- hR7's F1.1: a reordered declaration
    or an ``optional`` field would pass the name/number/type check and make the two paths differ."""
    numbers = [f.number for f in message.fields]
    if numbers != sorted(numbers):
        return False
    return not any(getattr(f, "has_presence", False) and not _repeats(f) and f.message_type is None
                   for f in message.fields)  # proto3 `optional` (a synthetic oneof) or a scalar oneof member


SEVERITY_NAMES = {0: "SEVERITY_UNSPECIFIED", 1: "DEBUG", 2: "INFO", 3: "WARNING", 4: "ERROR", 5: "CRITICAL"}
"""The Severity enum's names by number, as _fastread.c writes them."""


def _repeats(field: Any) -> bool:
    """Whether a field descriptor's field repeats (``is_repeated`` in protobuf >= 6, ``label`` before)."""
    flag = getattr(field, "is_repeated", None)
    return bool(flag) if flag is not None else field.label == field.LABEL_REPEATED


def _emit_double(value: float) -> Any:
    """A double as the JSON mapping writes it (NaN and +-Inf as strings)."""
    if value - value == 0.0:
        return value
    if value != value:
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


_HEADER = wire.envelope_header_emitters()
"""``(field, emit)`` of the envelope's non-payload fields, in the generic path's order."""
_EMIT = dict(_HEADER)


def _plain_batch(msg: Any) -> Any:
    """The MetricBatch of a metric-batch envelope without alert or context; None for any other."""
    if msg.WhichOneof("payload") != "metrics":
        return None
    batch = msg.metrics
    if batch.alert or len(batch.recent):
        return None
    return batch


def _point_dicts(batch: Any) -> List[Dict[str, Any]]:
    """The JSON mapping of a batch's points."""
    dicts: List[Dict[str, Any]] = []
    for point in batch.points:
        name, value, step = point.name, point.value, point.step
        d: Dict[str, Any] = {}
        if name:
            d["name"] = name
        if value:
            d["value"] = value if value - value == 0.0 else _emit_double(value)
        if step:
            d["step"] = step
        dicts.append(d)
    return dicts


def _points(batch: Any, envelope_step: int) -> List[extract.MetricTuple]:
    """A batch's points as :func:`~trainguard_engine.extract.metric_points` reads them (each field of a
    point read once: every read builds a Python object)."""
    return _read_points(batch.points, envelope_step)


def _read_points(messages: Any, envelope_step: int) -> List[extract.MetricTuple]:
    """:func:`_points` of a batch's repeated ``points`` field."""
    points: List[extract.MetricTuple] = []
    for point in messages:
        name = point.name
        if name:
            step = point.step
            points.append((name, step if step > 0 else envelope_step, point.value))
    return points


def _plain_metrics(msg: Any) -> Optional[Tuple[Dict[str, Any], List[extract.MetricTuple]]]:
    """The dict and points of a metric-batch envelope without alert or context; None for any other."""
    batch = _plain_batch(msg)
    if batch is None:
        return None
    out: Dict[str, Any] = {}
    for name, emit in _HEADER:
        value = getattr(msg, name)
        if value:
            out[name] = value if emit is None else emit(value, False)
    dicts = _point_dicts(batch)
    out["metrics"] = {"points": dicts} if dicts else {}
    return out, _points(batch, msg.step)


class _Record:
    """One serialized ``IngestRequest`` whose envelopes :func:`read_request` read, parsed again (once) when
    the mapping of one of them is asked for: what read_request hands out holds these bytes, not a message."""

    __slots__ = ("_events", "value")

    def __init__(self, value: bytes) -> None:
        self.value = value
        self._events: Any = None

    def envelope(self, index: int) -> Any:
        """The ``index``-th Envelope message of the request."""
        events = self._events
        if events is None:
            events = self._events = ingest_pb2.IngestRequest.FromString(self.value).events
        return events[index]


@plain_body
class PlainBatch(Mapping):  # type: ignore[type-arg]
    """The payload of a plain metric batch (points only: no alert, no recent context) as its JSON mapping,
    rendered (from envelope ``index`` of ``record``) when first asked for anything but ``alert`` and
    ``recent`` (absent by construction: registered with the pipeline as a plain body, which it then does
    not ask for them -- ``trainguard_engine.pipeline.PLAIN_BODIES``). ``count``: how many points the
    message holds (those without a name included: what the gateway's backlog counts,
    ``gateway.backlog.weight``), known without rendering."""

    __slots__ = ("_dict", "_index", "_record", "count")

    def __init__(self, record: _Record, index: int, count: int) -> None:
        self._record = record
        self._index = index
        self._dict: Optional[Dict[str, Any]] = None
        self.count = count

    def as_dict(self) -> Dict[str, Any]:
        """The payload's dict (built once)."""
        if self._dict is None:
            dicts = _point_dicts(self._record.envelope(self._index).metrics)
            self._dict = {"points": dicts} if dicts else {}
        return self._dict

    def get(self, key: Any, default: Any = None) -> Any:
        if key == "points":
            return self.as_dict().get(key, default)
        return default

    def __contains__(self, key: Any) -> bool:
        return key == "points" and key in self.as_dict()

    def __getitem__(self, key: str) -> Any:
        return self.as_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())


class PlainEnvelope(Mapping):  # type: ignore[type-arg]
    """A plain metric batch's envelope as its JSON mapping (``wire.envelope_to_dict``'s dict, key order
    included), each header field read from the message (envelope ``index`` of ``body``'s record) when
    asked for; ``metrics`` is the payload's dict."""

    __slots__ = ("_body", "_msg")

    def __init__(self, body: PlainBatch) -> None:
        self._body = body
        self._msg: Any = None

    def _message(self) -> Any:
        msg = self._msg
        if msg is None:
            body = self._body
            msg = self._msg = body._record.envelope(body._index)
        return msg

    def __getitem__(self, key: str) -> Any:
        if key == "metrics":
            return self._body.as_dict()
        if key not in _EMIT:
            raise KeyError(key)
        value = getattr(self._message(), key)
        if not value:
            raise KeyError(key)
        emit = _EMIT[key]
        return value if emit is None else emit(value, False)

    def __contains__(self, key: Any) -> bool:
        if key == "metrics":
            return True
        return key in _EMIT and bool(getattr(self._message(), key))

    def __iter__(self) -> Iterator[str]:
        msg = self._message()
        for name, _emit in _HEADER:
            if getattr(msg, name):
                yield name
        yield "metrics"

    def __len__(self) -> int:
        return sum(1 for _ in self)


def decode_request(value: bytes) -> Tuple[List[Dict[str, Any]], List[Points]]:
    """The envelope dicts of one serialized ``IngestRequest`` and each one's metric points (None for
    envelopes that are not metric batches). Raises what protobuf raises on bytes it cannot parse."""
    request = ingest_pb2.IngestRequest.FromString(value)
    envelopes: List[Dict[str, Any]] = []
    points: List[Points] = []
    for msg in request.events:
        read = _plain_metrics(msg)
        if read is not None:
            envelopes.append(read[0])
            points.append(read[1])
            continue
        env = wire.envelope_to_dict(msg)
        envelopes.append(env)
        points.append(extract.metric_points(env) if "metrics" in env else None)
    return envelopes, points


def read_request(value: bytes) -> Tuple[List[Envelope], List[Points]]:
    """:func:`decode_request` for a runtime that hands the pipeline what it read: a plain metric batch (no
    alert, no recent context, a run id) is a :class:`~trainguard_engine.pipeline.ReadEnvelope` whose
    ``raw`` (a :class:`PlainEnvelope`) equals its dict; every other envelope is its dict.

    With the native reader (:data:`NATIVE`) the plain batches are read from the request's bytes, and their
    ReadEnvelopes built, in one call (``read_envelopes``: :func:`prepare_native`), and the other envelopes
    (if any) from the request parsed by protobuf then; a request the native reader declines (its rules:
    _fastread.c) is read by :func:`read_request_protobuf`, as without it. Either way the result is the same,
    object for object (tests/services/processor/test_fastread.py)."""
    if NATIVE is None:
        return read_request_protobuf(value)
    record = _Record(value)
    read = NATIVE.read_envelopes(value, record)
    if read is None:
        return read_request_protobuf(value)
    envelopes, points, complete = read
    if not complete:  # the envelopes that are not plain batches: through protobuf
        events = ingest_pb2.IngestRequest.FromString(value).events
        for index, env in enumerate(envelopes):
            if env is None:
                envelopes[index], points[index] = _read_message(record, index, events[index])
    return envelopes, points


def read_request_protobuf(value: bytes) -> Tuple[List[Envelope], List[Points]]:
    """:func:`read_request` through protobuf alone: the request parsed, then each envelope read from its
    message (:func:`_read_message`)."""
    request = ingest_pb2.IngestRequest.FromString(value)
    record = _Record(value)
    envelopes: List[Envelope] = []
    points: List[Points] = []
    add_envelope, add_points = envelopes.append, points.append
    for index, msg in enumerate(request.events):
        env, pts = _read_message(record, index, msg)
        add_envelope(env)
        add_points(pts)
    return envelopes, points


def _read_message(record: _Record, index: int, msg: Any) -> Tuple[Envelope, Points]:
    """Envelope ``index`` of ``record`` read from its message: a plain batch (tested and read in place, its
    points by :func:`_read_points`) as read; every other envelope as :func:`decode_request` reads it."""
    if msg.WhichOneof("payload") == "metrics":
        batch = msg.metrics
        if not batch.alert and not len(batch.recent) and msg.run_id:  # plain, with a run id: as read
            step, world = msg.step, msg.world_size
            messages = batch.points
            body = PlainBatch(record, index, len(messages))
            return (ReadEnvelope(PlainEnvelope(body), "metrics", body, msg.event_id, msg.project, msg.run_id,
                                 msg.rank, step, msg.time_unix_nano, msg.host, msg.pid,
                                 world if world > 1 else 1, msg.run_name, msg.trace_id),
                    _read_points(messages, step))
    env = wire.envelope_to_dict(msg)
    return env, extract.metric_points(env) if "metrics" in env else None


NATIVE: Any = _native_reader()
"""The native reader :func:`read_request` uses (None: protobuf alone; tests set it)."""
