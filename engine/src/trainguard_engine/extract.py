"""Read envelopes (dicts in the JSON mapping of docs/wire-format.md) without trusting them to be complete.

Absent fields have their proto3 defaults (``0``, ``""``, empty); int64 fields may be numbers or decimal
strings; doubles may be ``"NaN"``/``"Infinity"``/``"-Infinity"``. The processor runtime uses
:func:`metric_points`, :func:`raw_text` and :func:`is_raw_context` to fill the metric and raw-context
stores; the pipeline uses the same readers, so what is stored and what is decided agree. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, List, Optional, Tuple

from trainguard.core.events import from_wire_float, payload_kind

from .catalogue import SIGNAL_NAMES

MetricTuple = Tuple[str, int, float]


def as_int(value: Any, default: int = 0) -> int:
    """An int32/int64 field: a number, an integral float or a decimal string; ``default`` when absent.
    Raises ValueError for anything else (a malformed envelope)."""
    if type(value) is int:  # the common case first: this runs for every field of every event
        return value
    if value is None:
        return default
    if isinstance(value, bool):
        raise ValueError(f"not an integer: {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        return int(value.strip())
    raise ValueError(f"not an integer: {value!r}")


def as_float(value: Any, default: float = 0.0) -> float:
    """A double field (number or the JSON mapping's strings); ``default`` when absent. Raises ValueError for
    anything else, an int beyond the double range included (a malformed value, as in both builds)."""
    if type(value) is float:
        return value
    if value is None:
        return default
    if isinstance(value, str) and value not in ("NaN", "Infinity", "-Infinity"):
        number = float(value)  # a numeric string ("1.5"); "nan"/"inf" spellings are not the mapping's
        if not math.isfinite(number):
            raise ValueError(f"not a double: {value!r}")
        return number
    try:
        return from_wire_float(value)
    except (OverflowError, RecursionError):  # an int past the double range; a value nested past repr's reach
        raise ValueError(f"not a double: a value of type {type(value).__name__} out of range") from None


def as_str(value: Any) -> str:
    """A string field; ``""`` when absent."""
    return value if isinstance(value, str) else ("" if value is None else str(value))


def payload(event: Mapping[str, Any]) -> Tuple[Optional[str], Mapping[str, Any]]:
    """``(kind, payload)`` of an envelope; ``(None, {})`` when it carries none."""
    kind = payload_kind(event)
    if kind is None:
        return None, {}
    body = event.get(kind)
    return kind, body if isinstance(body, (dict, Mapping)) else {}


def point_step(point: Mapping[str, Any], envelope_step: int) -> int:
    """The step of one Metric: its own ``step`` when set, else the envelope's.

    "Set" means present and neither 0 nor -1: proto3 cannot tell an explicit 0 from an absent field (a
    point that went through protobuf loses it), so 0 reads as "the envelope's step" on every path. A
    point at step 0 therefore rides in an envelope whose step is 0 (what the SDK does).
    """
    own = as_int(point.get("step"), 0)
    return own if own > 0 else envelope_step


def _points(items: Any, envelope_step: int, context: bool = False) -> List[MetricTuple]:
    out: List[MetricTuple] = []
    if not isinstance(items, (list, tuple)):
        return out
    for point in items:
        if not isinstance(point, (dict, Mapping)):
            continue
        name = point.get("name")
        if not isinstance(name, str) or not name:
            continue
        try:
            value = as_float(point.get("value"), 0.0)
            step = as_int(point.get("step"), 0) if context else point_step(point, envelope_step)
        except (TypeError, ValueError):
            continue  # one malformed point does not cost the others
        out.append((name, step, value))
    return out


def metric_points(event: Mapping[str, Any]) -> List[MetricTuple]:
    """``(name, step, value)`` for every point of a MetricBatch envelope (``[]`` for other kinds).

    A point's own step wins over the envelope's (see :func:`point_step`); NaN and +-Inf are floats
    (``math.nan``, ``math.inf``); a point without a name or with an unreadable value is skipped. The
    ``recent`` context of an alert is *not* included: those are past values, see :func:`recent_points`.
    """
    kind, body = payload(event)
    if kind != "metrics":
        return []
    return batch_points(body, envelope_step(event))


def batch_points(body: Mapping[str, Any], envelope_step: int) -> List[MetricTuple]:
    """:func:`metric_points` of a MetricBatch payload already taken out of its envelope."""
    return _points(body.get("points"), envelope_step)


def recent_points(event: Mapping[str, Any]) -> List[MetricTuple]:
    """The context of an alert (``MetricBatch.recent``) or of an exception (``recent_metrics``): past
    values, each at its own step (absent means 0 here: context never borrows the envelope's step)."""
    kind, body = payload(event)
    if kind == "metrics":
        return _points(body.get("recent"), envelope_step(event), context=True)
    if kind == "exception":
        return _points(body.get("recent_metrics"), envelope_step(event), context=True)
    return []


def envelope_step(event: Mapping[str, Any]) -> int:
    """The envelope's step (0 when absent, as proto3 reads it; -1 means unknown)."""
    try:
        return as_int(event.get("step"), 0)
    except ValueError:
        return -1


def _number_text(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return f"{value:.6g}"


def exit_summary(body: Mapping[str, Any]) -> str:
    """``"exit code 137 (SIGKILL), reason signal"`` for a lifecycle EXIT payload."""
    code = as_int(body.get("exit_code"), 0)
    signal = as_int(body.get("signal"), 0)
    text = f"exit code {code}"
    if signal:
        text += f" ({SIGNAL_NAMES.get(signal, f'signal {signal}')})"
    reason = as_str(body.get("reason"))
    if reason:
        text += f", reason {reason}"
    return text


def raw_text(event: Mapping[str, Any]) -> str:
    """What full-text search indexes for an envelope; ``""`` when it has nothing worth indexing.

    exception: ``type: message`` then the traceback (or the chain when there is no traceback); log: the
    logger, level and message; lifecycle: ``process exited: <exit summary>`` or ``process started:
    <argv>`` with versions; metrics with an alert: the alert and its non-finite values; memory: the
    allocator summary (sent on OOM). Plain metrics and heartbeats: ``""``.
    """
    try:
        return _raw_text(event)
    except (TypeError, ValueError):
        return ""


def _raw_text(event: Mapping[str, Any]) -> str:
    kind, body = payload(event)
    if kind == "exception":
        head = f"{as_str(body.get('type'))}: {as_str(body.get('message'))}"
        traceback = as_str(body.get("traceback"))
        if traceback:
            return f"{head}\n{traceback}"
        chain = body.get("chain")
        parts = [head]
        if isinstance(chain, list):
            for link in chain:
                if isinstance(link, Mapping):
                    parts.append(f"{as_str(link.get('type'))}: {as_str(link.get('message'))}")
        return "\n".join(parts)
    if kind == "log":
        logger, level = as_str(body.get("logger")), as_str(body.get("level"))
        prefix = " ".join(p for p in (level, logger) if p)
        message = as_str(body.get("message"))
        return f"{prefix}: {message}" if prefix else message
    if kind == "lifecycle":
        phase = as_str(body.get("phase"))
        if phase in ("EXIT", "2"):
            return f"process exited: {exit_summary(body)}"
        argv = body.get("argv")
        words = [as_str(a) for a in argv] if isinstance(argv, list) else []
        versions = [f"{k} {as_str(body.get(k))}" for k in ("python", "torch", "cuda") if body.get(k)]
        return "process started: " + " ".join(words) + (f" ({', '.join(versions)})" if versions else "")
    if kind == "metrics":
        alert = as_str(body.get("alert"))
        if not alert:
            return ""
        bad = [f"{n}={_number_text(v)} at step {s}" for n, s, v in metric_points(event)
               if not math.isfinite(v)]
        return f"alert {alert}: " + ", ".join(bad) if bad else f"alert {alert}"
    if kind == "memory":
        return as_str(body.get("summary"))
    return ""


def is_raw_context(event: Mapping[str, Any]) -> bool:
    """Whether the envelope belongs in the raw-context store (searchable, shown in drill-downs):
    exceptions, logs, lifecycle, metric batches with an alert, and memory snapshots with a summary."""
    kind, body = payload(event)
    if kind in ("exception", "log", "lifecycle"):
        return True
    if kind == "metrics":
        return bool(body.get("alert"))
    if kind == "memory":
        return bool(body.get("summary"))
    return False
