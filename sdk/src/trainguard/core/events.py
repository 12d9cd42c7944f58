"""Envelope construction and the JSON mapping of the wire schema (proto/trainguard/v1/events.proto).

Events travel inside the SDK and over HTTP as plain dicts in the proto3 JSON mapping with snake_case field
names, so the server can parse them with ``json_format.ParseDict`` and the SDK needs no protobuf. The one
wrinkle of that mapping is non-finite doubles, which are the strings ``"NaN"``, ``"Infinity"`` and
``"-Infinity"``; :func:`wire_float` and :func:`from_wire_float` convert.

Everything here is pure: no I/O, no clocks except where a caller passes one in.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

PAYLOAD_KINDS = ("metrics", "exception", "lifecycle", "heartbeat", "log", "memory")
SEVERITIES = ("SEVERITY_UNSPECIFIED", "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
ENVELOPE_FIELDS = (
    "event_id", "project", "run_id", "trace_id", "host", "pid", "rank", "local_rank", "world_size",
    "step", "time_unix_nano", "severity", "run_name", "sdk", "group_rank",
)

WireFloat = Union[float, str]
Event = Dict[str, Any]


def new_event_id() -> str:
    """A 32-hex-character random id, the idempotency key of one event."""
    return os.urandom(16).hex()


def wire_float(value: float) -> WireFloat:
    """``value`` as the proto3 JSON mapping writes a double: finite floats as is, else a string."""
    if value != value:
        return "NaN"
    if value == math.inf:
        return "Infinity"
    if value == -math.inf:
        return "-Infinity"
    return value


def from_wire_float(value: WireFloat) -> float:
    """Inverse of :func:`wire_float`; raises ValueError on anything that is not a double."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not a double")
    if isinstance(value, (int, float)):
        return float(value)
    if value in ("NaN", "Infinity", "-Infinity"):
        return float(value.replace("Infinity", "inf"))
    raise ValueError(f"not a double: {value!r}")


#: what the server refuses in a metric name (docs/security.md): C0 controls, DEL, C1 controls and Unicode's
#: bidirectional controls -- the server's rule for run ids too (gateway/validate.py)
_NAME_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(found: re.Match[str]) -> str:
    code = ord(found.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def metric_name(name: Any) -> Any:
    """``name`` as sent: a string holding a control or bidirectional control character gets each one
    written as its escape (``"loss\\x1b[2J"`` -> ``"loss\\\\x1b[2J"``), so the server, which refuses such
    names, keeps the event and its other metrics; anything else is returned as is. Never raises."""
    if isinstance(name, str) and _NAME_CONTROL.search(name):  # numpy.str_ too: a str subclass
        return _NAME_CONTROL.sub(_escape, name)
    return name


def _names_clean(values: Iterable[Any]) -> bool:
    """True when no name of ``values`` needs :func:`metric_name` (one regex over all, the common case)."""
    try:
        return _NAME_CONTROL.search("".join(values)) is None
    except TypeError:  # a name that is not a string: check one by one
        return False


def metric_points(values: Mapping[str, float], step: Optional[int] = None) -> List[Dict[str, Any]]:
    """Metric messages for ``values``; ``step`` (if given) is stamped on each point. Names go through
    :func:`metric_name`."""
    points: List[Dict[str, Any]] = []
    escape = not _names_clean(values)
    for name, value in values.items():
        point: Dict[str, Any] = {"name": metric_name(name) if escape else name, "value": wire_float(value)}
        if step is not None:
            point["step"] = step
        points.append(point)
    return points


def recent_points(recent: Iterable[Tuple[str, int, float]]) -> List[Dict[str, Any]]:
    """Metric messages for ``(name, step, value)`` context values, each with its own step (names as in
    :func:`metric_name`)."""
    return [{"name": metric_name(n), "step": s, "value": wire_float(v)} for n, s, v in recent]


def metrics_payload(values: Mapping[str, float], alert: str = "",
                    recent: Iterable[Tuple[str, int, float]] = ()) -> Dict[str, Any]:
    """A MetricBatch: ``values`` observed at the envelope's step, an optional alert and its context."""
    payload: Dict[str, Any] = {"points": metric_points(values)}
    if alert:
        payload["alert"] = alert
        payload["recent"] = recent_points(recent)
    return payload


def envelope(base: Mapping[str, Any], kind: str, payload: Mapping[str, Any], *, step: int,
             time_unix_nano: int, severity: str = "INFO", event_id: Optional[str] = None) -> Event:
    """One Envelope: the identity fields of ``base`` plus one payload of ``kind``."""
    if kind not in PAYLOAD_KINDS:
        raise ValueError(f"unknown payload kind {kind!r}")
    event = dict(base)
    event["event_id"] = event_id or new_event_id()
    event["step"] = step
    event["time_unix_nano"] = time_unix_nano
    event["severity"] = severity
    event[kind] = payload
    return event


def payload_kind(event: Mapping[str, Any]) -> Optional[str]:
    """Which payload an envelope dict carries, or None."""
    for kind in PAYLOAD_KINDS:
        if kind in event:
            return kind
    return None


def string_map(values: Mapping[Any, Any], max_len: int = 1024) -> Dict[str, str]:
    """A ``map<string,string>``: keys and values stringified (never raising) and truncated."""
    out: Dict[str, str] = {}
    for key, value in values.items():
        out[safe_str(key, 256)] = safe_str(value, max_len)
    return out


def safe_str(value: Any, max_len: int = 1024) -> str:
    """``str(value)`` truncated to ``max_len``; an object whose ``__str__`` raises gives its type name."""
    try:
        text = value if isinstance(value, str) else str(value)
    except Exception:  # a user object with a broken __str__ must not break the SDK
        text = f"<unprintable {type(value).__name__}>"
    if len(text) > max_len:
        text = text[: max_len - 15] + "...[truncated]"
    return text


def encode_batch(events: Sequence[Event]) -> bytes:
    """The HTTP ingest body for ``events`` (an IngestRequest in the JSON mapping), UTF-8 JSON.

    ``allow_nan=False`` guarantees that a non-finite float that skipped :func:`wire_float` fails here,
    loudly, instead of producing invalid JSON that the server would reject as a whole batch. Lone
    surrogates (argv or file names that are not UTF-8) become "?" rather than failing the batch.
    """
    return json.dumps({"events": list(events)}, separators=(",", ":"), allow_nan=False,
                      ensure_ascii=False).encode("utf-8", "replace")


def encode_event(event: Event) -> bytes:
    """One envelope as a JSON line (the ``file://`` transport and the spool use this)."""
    return json.dumps(event, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode("utf-8",
                                                                                               "replace")


def decode_events(body: bytes) -> List[Event]:
    """Parse an IngestRequest JSON body; raises ValueError with a precise message when malformed."""
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("events"), list):
        raise ValueError('body must be a JSON object with an "events" array')
    return doc["events"]
