"""``trainguard replay``: import a finished run that had no SDK -- metrics JSON-lines, log files, exit codes,
optionally per rank -- into the backend as a run, through the same ingest path as live events, so the same
pipeline classifies it.

Modules: :mod:`.metrics_jsonl` (metrics files and the field-name mapping), :mod:`.logs` (log lines and
tracebacks), :mod:`.times` (timestamps), :mod:`.importer` (envelopes, ids, times, batching),
:mod:`.backends` (HTTP/gRPC endpoint or a data directory), :mod:`.report` (progress and summary).
"""

from __future__ import annotations

from .backends import Backend, LocalBackend, RemoteBackend
from .importer import Importer, ReplayOptions, ReplaySummary, event_id, wait_for_run
from .metrics_jsonl import AUTO_MAP, AUTO_PREFIX_MAP, STEP_FIELDS, TIME_FIELDS, FieldMap

__all__ = [
    "AUTO_MAP",
    "AUTO_PREFIX_MAP",
    "STEP_FIELDS",
    "TIME_FIELDS",
    "Backend",
    "FieldMap",
    "Importer",
    "LocalBackend",
    "RemoteBackend",
    "ReplayOptions",
    "ReplaySummary",
    "event_id",
    "wait_for_run",
]
