"""The metric point names of a serialized ``IngestRequest``, per envelope, at C speed.

What the per-run metric-name bound (:mod:`.metric_names`) and the points-counted backlog (:mod:`.backlog`)
need of a request is each envelope's point names and count. Read through the decoded envelopes that is a
Python object per point (~1.2 µs per 5-point envelope, more than the rest of the gateway's work). Here the
request is parsed a second time (upb, in C) as a view that knows only ``Envelope.metrics.points[].name``
(and the other ``payload`` members, so the oneof's last-one-wins is the same), everything else dropped, and
serialized again: each envelope becomes its *shape*, the bytes of its point names alone. An SDK sends the
same names every step, so a request's shapes are nearly all one, and a shape is decoded once
(:meth:`PointNames.shape`, cached).

Contract:

* :meth:`PointNames.names_only` ``(raw)`` -> ``raw`` as that view serialized (None when the view cannot
  parse it: the caller reads the envelopes then); :meth:`PointNames.split` ``(names_only, n)`` -> one shape
  per envelope, in order (as many as ``IngestRequest.FromString(raw)`` has envelopes).
* :meth:`PointNames.uniform` ``(names_only, n)`` -> the one shape of all ``n`` envelopes when they share
  it and it is the last shape a whole request had (one comparison of bytes), else None.
* :meth:`PointNames.shape` ``(shape)`` -> :class:`Shape`: ``kind`` (the envelope's
  ``WhichOneof('payload')``), ``metrics`` (``kind == 'metrics'``), ``names`` (its points' names in order,
  empty ones included, as ``[p.name for p in envelope.metrics.points]``) and ``weight``
  (:func:`.backlog.weight`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

__all__ = ["PointNames", "Shape"]

_F = descriptor_pb2.FieldDescriptorProto
#: Envelope's payload oneof: metrics = 20, then exception, lifecycle, heartbeat, log, memory (events.proto)
_METRICS_FIELD = 20
_OTHER_PAYLOADS = ("exception", "lifecycle", "heartbeat", "log", "memory")
#: shapes remembered decoded (each at most _CACHED_BYTES long): bounds the cache's memory (~4 MiB)
_CACHED = 1024
_CACHED_BYTES = 4096


def _view_classes() -> Tuple[Any, Any, Any]:
    """(request view, envelope view, the raw splitter ``repeated bytes events = 1``)."""
    proto = descriptor_pb2.FileDescriptorProto(name="trainguard_server/gateway/point_names.proto",
                                               package="trainguard_server.gateway.names", syntax="proto3")
    pkg = ".trainguard_server.gateway.names."
    name = proto.message_type.add(name="Point")
    name.field.add(name="name", number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
    batch = proto.message_type.add(name="Batch")
    batch.field.add(name="points", number=1, type=_F.TYPE_MESSAGE, type_name=pkg + "Point",
                    label=_F.LABEL_REPEATED)
    proto.message_type.add(name="Other")
    env = proto.message_type.add(name="Envelope")
    env.oneof_decl.add(name="payload")
    env.field.add(name="metrics", number=_METRICS_FIELD, type=_F.TYPE_MESSAGE, type_name=pkg + "Batch",
                  label=_F.LABEL_OPTIONAL, oneof_index=0)
    for i, other in enumerate(_OTHER_PAYLOADS, start=_METRICS_FIELD + 1):
        env.field.add(name=other, number=i, type=_F.TYPE_MESSAGE, type_name=pkg + "Other",
                      label=_F.LABEL_OPTIONAL, oneof_index=0)
    request = proto.message_type.add(name="Request")
    request.field.add(name="events", number=1, type=_F.TYPE_MESSAGE, type_name=pkg + "Envelope",
                      label=_F.LABEL_REPEATED)
    raw = proto.message_type.add(name="RawRequest")
    raw.field.add(name="events", number=1, type=_F.TYPE_BYTES, label=_F.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)

    def cls(n: str) -> Any:
        return message_factory.GetMessageClass(pool.FindMessageTypeByName(pkg[1:] + n))

    return cls("Request"), cls("Envelope"), cls("RawRequest")


_Request, _Envelope, _RawRequest = _view_classes()


@dataclass(frozen=True)
class Shape:
    """One envelope's metric points as the name bound and the backlog count them."""

    metrics: bool
    names: Tuple[str, ...]
    weight: int
    kind: Optional[str] = None  # the envelope's payload case (``WhichOneof('payload')``)


class PointNames:
    """Shapes of requests (see the module doc); thread-safe."""

    def __init__(self) -> None:
        self._cache: Dict[bytes, Shape] = {}
        self._last = b""  # the shape a whole request last had
        self._lock = threading.Lock()

    def names_only(self, raw: bytes) -> Optional[bytes]:
        """``raw`` with only its envelopes' payload case and point names left (a serialized request view);
        None when the view cannot parse it."""
        try:
            view = _Request.FromString(raw)
        except DecodeError:
            return None
        view.DiscardUnknownFields()
        return bytes(view.SerializeToString())

    def uniform(self, names_only: bytes, n: int) -> Optional[bytes]:
        """The shape every one of the ``n`` envelopes of ``names_only`` has, when it is the last such shape
        seen; else None."""
        last = self._last
        if n and len(names_only) == n * (len(last) + 1 + _varint_len(len(last))) \
                and names_only == _framed(last) * n:
            return last
        return None

    def split(self, names_only: bytes, n: int) -> Optional[List[bytes]]:
        """One shape per envelope; remembers it as :meth:`uniform`'s when all ``n`` share one."""
        shapes = list(_RawRequest.FromString(names_only).events)
        if len(shapes) != n:  # pragma: no cover - the view and the request disagree on the framing
            return None
        if n and shapes.count(shapes[0]) == n and len(shapes[0]) <= _CACHED_BYTES:
            self._last = shapes[0]
        return shapes

    def shape(self, shape: bytes) -> Shape:
        """The decoded shape (cached when small)."""
        got = self._cache.get(shape)
        if got is not None:
            return got
        env = _Envelope.FromString(shape)
        kind = env.WhichOneof("payload")
        if kind == "metrics":
            names = tuple(p.name for p in env.metrics.points)
            got = Shape(True, names, max(1, len(names)), kind)
        else:
            got = Shape(False, (), 1, kind)
        if len(shape) <= _CACHED_BYTES:
            with self._lock:
                if len(self._cache) >= _CACHED:
                    self._cache.clear()
                self._cache[shape] = got
        return got


def _varint_len(n: int) -> int:
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


def _framed(shape: bytes) -> bytes:
    """``shape`` as one ``events`` field of a request (tag, length, bytes)."""
    out = bytearray(b"\x0a")
    n = len(shape)
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out) + shape
