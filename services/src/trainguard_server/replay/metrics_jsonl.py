"""Metrics JSON-lines files (one object per step): the record type, the step/time/rank conventions shared by
every dict-shaped reader, and the cheap time scan (the reader itself is :class:`.sources.jsonl.JsonlSource`,
re-exported here as :class:`MetricsReader`; names and units: :mod:`.signals`).

Contract of a JSON-lines file (iterate the reader; counts land in :attr:`MetricsReader.stats`):

* One JSON object per line; blank lines are ignored. A line that is not JSON, or not an object, or whose
  step is not a non-negative integer, is **skipped and counted** with its line number
  (:attr:`MetricsStats.malformed`); never fatal. Python's ``json`` reads ``NaN``, ``Infinity`` and
  ``-Infinity`` literals; the strings ``"nan"``, ``"inf"``, ``"-inf"``, ``"infinity"`` (any case) and
  numeric strings (``"3e-4"``) are numbers too.
* **Step**: the first of :data:`STEP_FIELDS` present (``step``, ``global_step``, ``trainer/global_step``,
  ``iteration``, ``iter``, ``_step``), or ``step_field``. When the first readable object has none of them
  the file is numbered by position (0, 1, 2, ... over non-blank lines; :attr:`MetricsStats.numbered`);
  otherwise an object without one is skipped and counted in ``no_step``.
* **Time**: the first of :data:`TIME_FIELDS` present whose value is an absolute time (see
  :mod:`.times`), or ``time_field``; None otherwise (the importer supplies one).
* **Rank**: an integer ``rank`` field routes the object to that rank (else the file's rank).
* **Values**: every other field. Numbers and booleans (0/1) are metrics; nested objects are flattened with
  ``/`` (``{"grad_norm": {"layer1": 0.1}}`` → ``grad_norm/layer1``); anything else (strings, lists, null)
  is ignored and counted by field name in ``non_numeric``. Then :class:`~.signals.Recognizer` renames and
  converts units (``FieldMap`` is its old name).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .signals import Recognizer, parse_map_rule, to_number
from .signals_table import SIGNALS
from .times import parse_time_value

STEP_FIELDS = ("step", "global_step", "trainer/global_step", "iteration", "iter", "_step")
TIME_FIELDS = ("time", "timestamp", "_timestamp", "wall_time", "walltime", "time_unix_nano")
RANK_FIELD = "rank"
MAX_REPORTED = 20
"""Malformed lines kept with their line number and reason (all are counted)."""

FieldMap = Recognizer
AUTO_MAP: Dict[str, str] = {n: s.target for s in SIGNALS if not s.target.endswith("/") for n in s.names}
"""The synonym table's exact names (normalised; see :mod:`.signals_table`)."""
AUTO_PREFIX_MAP: Dict[str, str] = {p: s.target for s in SIGNALS for p in s.prefixes}
"""The synonym table's per-layer families."""

def to_step(value: Any) -> Optional[int]:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        step = value
    elif isinstance(value, float) and value.is_integer():
        step = int(value)
    elif isinstance(value, str) and value.strip().lstrip("+").isdigit():
        step = int(value)
    else:
        return None
    return step if 0 <= step < 2**62 else None


@dataclass
class MetricsRecord:
    """One object of a metrics file: its line number, position among the non-blank lines (0-based), step,
    time (None: unknown), rank (None: the file's) and values."""

    line: int
    position: int
    step: int
    time_ns: Optional[int]
    rank: Optional[int]
    values: Dict[str, float]


@dataclass
class MetricsStats:
    """What reading one file found."""

    lines: int = 0                 # non-blank lines
    records: int = 0               # objects turned into records
    points: int = 0                # metric values in them
    malformed: int = 0             # lines skipped: not JSON, not an object, bad step
    malformed_lines: List[Tuple[int, str]] = field(default_factory=list)  # the first MAX_REPORTED
    no_step: int = 0               # objects without a step field (skipped)
    no_values: int = 0             # objects with no numeric field left (no envelope)
    non_numeric: Counter[str] = field(default_factory=Counter)  # ignored fields by name
    dropped_by_map: int = 0
    numbered: bool = False         # no step field in the file: steps are line positions
    step_field: str = ""
    time_field: str = ""

    def bad(self, line: int, reason: str) -> None:
        self.malformed += 1
        if len(self.malformed_lines) < MAX_REPORTED:
            self.malformed_lines.append((line, reason))


def peek_times(path: Path, *, time_field: Optional[str] = None, tail_bytes: int = 1 << 16
               ) -> Tuple[int, Optional[int], Optional[int]]:
    """(non-blank lines, time of the first record that has one, time of the last) -- cheaply: counts
    lines, reads objects from the head until one has a time and from the last ``tail_bytes`` backwards."""
    names = (time_field,) if time_field else TIME_FIELDS
    lines = 0
    first: Optional[int] = None
    with open(path, "rb") as fh:
        for raw in fh:
            if not raw.strip():
                continue
            lines += 1
            if first is None and lines <= 1000:
                first = _time_of(raw, names)
        size = fh.tell()
        fh.seek(max(0, size - tail_bytes))
        tail = fh.read().splitlines()
    last: Optional[int] = None
    for raw in reversed(tail):
        last = _time_of(raw, names)
        if last is not None:
            break
    return lines, first, last


def _time_of(raw: bytes, names: Sequence[str]) -> Optional[int]:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    for name in names:
        if name in obj:
            parsed = parse_time_value(obj[name])
            if parsed is not None:
                return parsed
    return None


from .sources.jsonl import MetricsReader  # noqa: E402  (the reader; defined after the names it uses)

__all__ = [
    "AUTO_MAP",
    "AUTO_PREFIX_MAP",
    "RANK_FIELD",
    "STEP_FIELDS",
    "TIME_FIELDS",
    "FieldMap",
    "MetricsReader",
    "MetricsRecord",
    "MetricsStats",
    "parse_map_rule",
    "peek_times",
    "to_number",
    "to_step",
]
