"""Stack-fingerprint clusters: every exception of a project with one fingerprint, across runs and ranks.

A cluster counts distinct exception events (the pipeline drops replayed duplicates before they get here),
keeps first/last seen, the affected runs, ``run:rank`` pairs and hosts (each capped at
``cluster_max_members``, first seen first), and one sample: the earliest exception by event time (ties:
the smaller event id), so the sample does not depend on arrival order. Handled exceptions count too.
At most ``max_clusters`` are kept; beyond it the least recently seen is evicted (its record stays in the
store; a later occurrence starts counting again from 1). Pure.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

from trainguard.core.fingerprint import (
    FINGERPRINT_VERSION,
    FrameInfo,
    fingerprint,
    is_library_path,
    module_from_filename,
)

from .catalogue import DetectionSettings
from .extract import as_int, as_str
from .records import Cluster
from .state import ClusterState, cluster_key

SAMPLE_FRAMES = 50
"""Innermost frames kept in a cluster's sample."""


def _frames(body: Mapping[str, Any]) -> List[FrameInfo]:
    out = []
    items = body.get("frames")
    for frame in items if isinstance(items, list) else []:
        if not isinstance(frame, Mapping):
            continue
        filename = as_str(frame.get("filename"))
        in_app = frame.get("in_app")
        out.append(FrameInfo(
            filename=filename, module=as_str(frame.get("module")) or module_from_filename(filename),
            function=as_str(frame.get("function")), lineno=as_int(frame.get("lineno"), 0),
            in_app=bool(in_app) if in_app is not None else not is_library_path(filename)))
    return out


def identify(body: Mapping[str, Any]) -> Tuple[str, str, str, str]:
    """``(fingerprint, version, type, message template)`` of an ExceptionEvent payload: the SDK's when it
    sent one, else computed here from type, message and frames with the current version."""
    exc_type = as_str(body.get("type")) or "<unknown exception>"
    sent = as_str(body.get("fingerprint"))
    if sent:
        return (sent, as_str(body.get("fingerprint_version")) or FINGERPRINT_VERSION, exc_type,
                as_str(body.get("message_template")))
    fp = fingerprint(exc_type, as_str(body.get("message")), _frames(body))
    return fp.hash, fp.version, fp.exc_type, fp.message_template


def _frame_dict(frame: Mapping[str, Any]) -> Dict[str, Any]:
    """A Frame with every field present (the JSON and protobuf paths differ in which defaults they omit)."""
    return {"filename": as_str(frame.get("filename")), "module": as_str(frame.get("module")),
            "function": as_str(frame.get("function")), "lineno": as_int(frame.get("lineno"), 0),
            "in_app": bool(frame.get("in_app")), "context_line": as_str(frame.get("context_line"))}


def _hint_dict(hint: Mapping[str, Any]) -> Dict[str, Any]:
    return {"frame_index": as_int(hint.get("frame_index"), 0), "contributes": bool(hint.get("contributes")),
            "reason": as_str(hint.get("reason"))}


def _sample(body: Mapping[str, Any], settings: DetectionSettings) -> Dict[str, Any]:
    """Type, message, the innermost frames, the fingerprint hints and the (trimmed) traceback, every field
    spelled out so that the sample is the same whichever path (JSON, protobuf) the event took."""
    frames = body.get("frames")
    hints = body.get("hints")
    traceback = as_str(body.get("traceback"))
    limit = settings.sample_traceback_chars
    if len(traceback) > limit:
        traceback = "...[trimmed]\n" + traceback[len(traceback) - limit:] if limit else ""
    return {
        "type": as_str(body.get("type")), "message": as_str(body.get("message")),
        "frames": [_frame_dict(f) for f in frames[-SAMPLE_FRAMES:] if isinstance(f, Mapping)]
        if isinstance(frames, list) else [],
        "hints": [_hint_dict(h) for h in hints if isinstance(h, Mapping)] if isinstance(hints, list) else [],
        "traceback": traceback,
        "mechanism": as_str(body.get("mechanism")), "handled": bool(body.get("handled")),
    }


def _add_capped(items: List[str], item: str, most: int) -> None:
    if item and item not in items and len(items) < most:
        items.append(item)


def observe(clusters: Dict[str, ClusterState], project: str, run_id: str, rank: int, host: str,
            event_id: str, time_ns: int, body: Mapping[str, Any], settings: DetectionSettings
            ) -> Tuple[ClusterState, int]:
    """Count one (new, de-duplicated) exception event into its cluster, creating it if needed.
    Returns the cluster and how many clusters were evicted to make room (0 or 1). What can fail on a
    malformed body (identifying it, its sample) is done before anything changes, so an event that raises
    leaves no half-built cluster behind."""
    fp, version, exc_type, template = identify(body)
    key = cluster_key(project, fp)
    state = clusters.get(key)
    candidate = (time_ns, event_id)
    new_sample = state is None or not state.record.sample_event_id or candidate < state.sample_key
    sample = _sample(body, settings) if new_sample else None
    evicted = 0
    if state is None:
        if len(clusters) >= settings.max_clusters:
            oldest = min(clusters, key=lambda k: (clusters[k].record.last_ns, k))
            del clusters[oldest]
            evicted = 1
        state = clusters[key] = ClusterState(Cluster(project=project, fingerprint=fp,
                                                     fingerprint_version=version, exc_type=exc_type,
                                                     message_template=template))
    rec = state.record
    rec.count += 1
    rec.first_ns = min(rec.first_ns, time_ns) if rec.first_ns else time_ns
    rec.last_ns = max(rec.last_ns, time_ns)
    most = settings.cluster_max_members
    _add_capped(rec.runs, run_id, most)
    _add_capped(rec.ranks, f"{run_id}:{rank}", most)
    _add_capped(rec.hosts, host, most)
    if sample is not None:  # new_sample
        state.sample_key = candidate
        rec.sample_event_id = event_id
        rec.sample = sample
        if template and not rec.message_template:
            rec.message_template = template
    state.dirty = True
    return state, evicted
