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
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from trainguard import wire
from trainguard.v1 import ingest_pb2
from trainguard_engine import extract

Points = Optional[List[extract.MetricTuple]]
"""An envelope's metric points (None: not a metric batch)."""


def _emit_double(value: float) -> Any:
    """A double as the JSON mapping writes it (NaN and +-Inf as strings)."""
    if value - value == 0.0:
        return value
    if value != value:
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


_HEADER = wire.envelope_header_emitters()
"""``(field, emit)`` of the envelope's non-payload fields, in the generic path's order."""


def _plain_metrics(msg: Any) -> Optional[Tuple[Dict[str, Any], List[extract.MetricTuple]]]:
    """The dict and points of a metric-batch envelope without alert or context; None for any other."""
    if msg.WhichOneof("payload") != "metrics":
        return None
    batch = msg.metrics
    if batch.alert or len(batch.recent):
        return None
    out: Dict[str, Any] = {}
    for name, emit in _HEADER:
        value = getattr(msg, name)
        if value:
            out[name] = value if emit is None else emit(value, False)
    envelope_step = msg.step
    dicts: List[Dict[str, Any]] = []
    points: List[extract.MetricTuple] = []
    for point in batch.points:
        name, value, step = point.name, point.value, point.step
        d: Dict[str, Any] = {}
        if name:
            d["name"] = name
            points.append((name, step if step > 0 else envelope_step, value))
        if value:
            d["value"] = value if value - value == 0.0 else _emit_double(value)
        if step:
            d["step"] = step
        dicts.append(d)
    out["metrics"] = {"points": dicts} if dicts else {}
    return out, points


def decode_request(value: bytes) -> Tuple[List[Dict[str, Any]], List[Points]]:
    """The envelope dicts of one serialized ``IngestRequest`` and each one's metric points (None for
    envelopes that are not metric batches). Raises what protobuf raises on bytes it cannot parse."""
    request = ingest_pb2.IngestRequest.FromString(value)
    envelopes: List[Dict[str, Any]] = []
    points: List[Points] = []
    for msg in request.events:
        fast = _plain_metrics(msg)
        if fast is not None:
            envelopes.append(fast[0])
            points.append(fast[1])
            continue
        env = wire.envelope_to_dict(msg)
        envelopes.append(env)
        points.append(extract.metric_points(env) if "metrics" in env else None)
    return envelopes, points
